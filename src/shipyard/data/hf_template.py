"""A Hugging Face model's own chat template: load it, render it as transformers does, derive the loss mask.

Where the template lives (transformers' order): `chat_template.jinja` next to
tokenizer.json, else `chat_template` in tokenizer_config.json (a string, or a
list of {name, template} of which "default" is used).

Rendering re-implements transformers' `apply_chat_template`: a sandboxed,
immutable Jinja environment with trim_blocks and lstrip_blocks, the
`loopcontrols` extension and `{% generation %}` blocks, `tojson` that keeps
non-ASCII text (ensure_ascii=False, optional indent), and the variables
`messages`, `add_generation_prompt`, `tools=None`, `documents=None`, the
tokenizer's named special tokens (`bos_token`, `eos_token`, ... from
tokenizer_config.json) and the helpers `raise_exception(msg)` and
`strftime_now(fmt)`. The rendered text is tokenized once, special-token
parsing on and no added BOS/EOS (the template writes its own), exactly as
transformers tokenizes it, so the ids match `apply_chat_template` token for
token; a special-token string inside a message is therefore parsed as that
token here too.

Loss mask, in characters of the rendered text, then per token (a token is
trained when its characters overlap a trained span):

- with `{% generation %}` blocks: their output, as written by the template;
- otherwise each assistant turn i is rendered prefix by prefix: the text of
  messages[:i] with the generation prompt ends where the turn starts, the text
  of messages[:i+1] without it ends where it stops. Of that turn, whitespace
  after its last special token is not trained (ChatML's newline after
  <|im_end|>, like the built-in chatml template), so what trains is the
  assistant content and the end-of-turn token(s) the template writes after it
  (<|im_end|>, <|eot_id|>, </s>, ...). A template that renders an earlier turn
  differently once more messages follow has no such prefixes: that is an
  error asking for `{% generation %}` blocks.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from os.path import commonprefix
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shipyard.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens transformers passes to a chat template by name."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: outputs its body and, while recording, notes where it went."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.recording: ContextVar = ContextVar("shipyard_generation_blocks", default=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller) -> str:
        out = caller()
        state = self.recording.get()
        if state is not None:  # (chunks yielded so far, spans found so far)
            chunks, spans = state
            start = sum(map(len, chunks))
            spans.append((start, start + len(out), out))
        return out

    @contextmanager
    def record(self, chunks: list[str], spans: list):
        token = self.recording.set((chunks, spans))
        try:
            yield
        finally:
            self.recording.reset(token)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the class itself (no attribute tricks)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() refusing underscore names, so a template can't reach Python internals through it."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` stays possible
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters and ignores ensure_ascii)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@dataclass
class HFTemplate:
    """A compiled HF chat template and the special tokens it is rendered with."""

    source: str
    where: str
    """Where it came from, for messages: the .jinja file, or tokenizer_config.json (chat_template)."""
    tokens: dict[str, str]
    """Named special tokens (bos_token, eos_token, ...) from tokenizer_config.json."""
    name: str = "hf"
    _template: jinja2.Template = field(init=False, repr=False)
    has_generation_blocks: bool = field(init=False)
    """The template marks the assistant output with {% generation %} blocks (then they are the loss mask)."""
    _blocks: _GenerationBlocks = field(init=False, repr=False)

    def __post_init__(self):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(
            raise_exception=self._raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
            dict=_Dict(),
            namespace=_Namespace,
        )
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(
                f"chat template {self.where}: does not parse (line {e.lineno}: {_one_line(e.message)})"
            ) from e
        self._blocks = next(x for x in env.extensions.values() if isinstance(x, _GenerationBlocks))
        self.has_generation_blocks = any(
            isinstance(node.call.node, jinja2.nodes.ExtensionAttribute) and node.call.node.name == "_block"
            for node in env.parse(self.source).find_all(jinja2.nodes.CallBlock)
        )

    def _raise_exception(self, message) -> None:
        raise DataError(f"chat template {self.where}: raise_exception: {_one_line(message)}")

    def _context(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> dict:
        # a message's tool calls and a tool result's id and name go through as transformers passes them
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        return {
            **self.tokens,
            "messages": [{k: m[k] for k in keep if k in m} for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
        }

    def _run(self, fn):
        try:
            return fn()
        except DataError:
            raise
        except Exception as e:  # a Jinja error (undefined, security, ...) or one the template's Python raises
            raise DataError(
                f"chat template {self.where}: rendering failed ({type(e).__name__}: {_one_line(e)})"
            ) from e

    def text(
        self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None
    ) -> str:
        """The rendered conversation (what `apply_chat_template(..., tools=tools, tokenize=False)` returns)."""
        return self._run(lambda: self._template.render(self._context(messages, add_generation_prompt, tools)))

    def generation_spans(self, messages: list[dict], add_generation_prompt: bool = False):
        """(text, [(start, end)] in characters of what the `{% generation %}` blocks wrote)."""

        def go():
            chunks: list[str] = []
            spans: list = []
            with self._blocks.record(chunks, spans):
                for chunk in self._template.generate(self._context(messages, add_generation_prompt)):
                    chunks.append(chunk)
            return "".join(chunks), spans

        text, spans = self._run(go)
        for start, end, out in spans:
            if text[start:end] != out:  # a block inside a macro or a captured {% set %}: its place is unknown
                raise DataError(
                    f"chat template {self.where}: a {{% generation %}} block is rendered inside a macro or a "
                    "captured block, so where its text lands is unknown; put it at the top level of the loop"
                )
        return text, [(s, e) for s, e, _ in spans]

    def turn_spans(self, messages: list[dict], add_generation_prompt: bool = False):
        """(text, [(start, end)] of each assistant turn), found by rendering the conversation prefix by prefix."""
        text = self.text(messages, add_generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True)
            upto = self.text(messages[: i + 1], add_generation_prompt=False)
            if not text.startswith(upto):
                raise DataError(
                    f"chat template {self.where}: renders assistant message {i} differently when more messages "
                    "follow, so its place in the conversation can't be found by rendering prefixes; wrap the "
                    "assistant output in {% generation %}...{% endgeneration %}"
                )
            # the generation prompt is the turn's header; if the template writes a different one for a finished
            # turn, the turn starts where the two part
            start = len(before) if upto.startswith(before) else len(commonprefix([before, upto]))
            spans.append((start, len(upto)))
        return text, spans


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_dir(tok_path: str | Path) -> Path:
    path = Path(tok_path)
    return path if path.is_dir() else path.parent


def load_hf_template(tok_path: str | Path) -> HFTemplate | None:
    """The tokenizer's own chat template (None when it has none), compiled."""
    base = tokenizer_dir(tok_path)
    config_file = base / CONFIG_FILE
    config: dict = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(
                f"tokenizer config {config_file}: not valid JSON ({e.msg}, line {e.lineno})"
            ) from e
        if not isinstance(config, dict):
            raise DataError(f"tokenizer config {config_file}: expected a JSON object")
    tokens = {k: name for k in NAMED_TOKENS if (name := _token_name(config.get(k))) is not None}
    template_file = base / TEMPLATE_FILE
    if template_file.is_file():
        return HFTemplate(template_file.read_text(encoding="utf-8"), str(template_file), tokens)
    source = config.get("chat_template")
    if source is None:
        return None
    where = f"{config_file} (chat_template)"
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(
                f"chat template {where}: a list of templates without one named 'default' "
                f"(names: {', '.join(map(str, named)) or 'none'})"
            )
        source, where = named["default"], f"{config_file} (chat_template 'default')"
    if not isinstance(source, str):
        raise DataError(f"chat template {where}: expected a string, got {type(source).__name__}")
    return HFTemplate(source, where, tokens)


def _tokens_in(offsets, start: int, end: int) -> list[int]:
    """Tokens whose characters overlap [start, end) (an empty token counts where it stands)."""
    return [t for t, (s, e) in enumerate(offsets) if (e > start and s < end) or (s == e and start <= s < end)]


class HFChat:
    """A tokenizer plus an HF chat template: token ids and loss masks of conversations, end-of-turn ids."""

    def __init__(self, tok, template: HFTemplate):
        from tokenizers import Tokenizer

        self.template = template
        # A copy that parses special tokens (they are in the template's text) and has no post-processor: with
        # add_special_tokens=False a post-processor adds nothing, but a byte-level one trims whitespace off the
        # offsets, and the mask needs every token's true characters. The ids are the tokenizer's own.
        self._enc = Tokenizer.from_str(tok.to_str())
        self._enc.post_processor = None
        self._enc.encode_special_tokens = False
        self._added = set(tok.get_added_tokens_decoder())
        self.end_ids = self._end_of_turn_ids(tok)

    def encode(self, text: str):
        """The `tokenizers.Encoding` of rendered text: how transformers tokenizes apply_chat_template's output
        (special tokens parsed, nothing added: the template writes its own BOS)."""
        return self._enc.encode(text, add_special_tokens=False)

    def prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The conversation and the generation prompt, ready for the model's reply (`tools`: the
        functions the model may call, in OpenAI's shape, for a template that renders them)."""
        return list(self.encode(self.template.text(messages, add_generation_prompt=True, tools=tools)).ids)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token is trained)."""
        if self.template.has_generation_blocks:
            text, spans = self.template.generation_spans(messages, add_generation_prompt)
            enc = self.encode(text)
            trained = {t for s, e in spans for t in _tokens_in(enc.offsets, s, e)}
        else:
            text, spans = self.template.turn_spans(messages, add_generation_prompt)
            enc = self.encode(text)
            trained = set()
            for s, e in spans:
                trained.update(self._turn(text, enc, _tokens_in(enc.offsets, s, e)))
        return list(enc.ids), [int(t in trained) for t in range(len(enc.ids))]

    def _turn(self, text: str, enc, turn: list[int]) -> list[int]:
        """A turn's trained tokens: all of it but whitespace after its last special token (that whitespace
        separates it from the next turn, like ChatML's newline after <|im_end|>)."""
        keep = len(turn)
        while keep and enc.ids[turn[keep - 1]] not in self._added:
            s, e = enc.offsets[turn[keep - 1]]
            if text[s:e].strip():
                return turn  # text, not whitespace, after the last special token: all of it trains
            keep -= 1
        return turn[:keep] if keep else turn

    def _end_of_turn_ids(self, tok) -> tuple[int, ...]:
        """The special token the template writes right after an assistant message (the last trained token of a
        two-message probe), then the tokenizer's eos_token."""
        ids = []
        try:
            probe_ids, mask = self.render(_PROBE)
            last = max((t for t, m in enumerate(mask) if m), default=None)
            if last is not None and probe_ids[last] in self._added:
                ids.append(probe_ids[last])
        except DataError:  # a template that refuses the probe (e.g. wants a system message): eos alone
            pass
        eos = self.template.tokens.get("eos_token")
        eos_id = tok.token_to_id(eos) if eos is not None else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        if not ids:
            raise DataError(
                f"chat template {self.template.where}: no end-of-turn token (the template writes no special "
                "token after an assistant message, and tokenizer_config.json names no eos_token the tokenizer has)"
            )
        return tuple(ids)


_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}]
