"""Talking to a fine-tuned model: replies with the chat template, streamed; `shipyard chat`; exact match.

A reply is the model's continuation of the rendered conversation plus the
assistant header, up to the template's end-of-turn token. Streaming decodes
the reply so far after every token and prints only the new text, holding
back an incomplete UTF-8 sequence (a byte-level token can end mid-character).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shipyard.data.chat_format import ChatFormat
from shipyard.errors import DataError


@dataclass
class ChatModel:
    """A run's params behind a compiled Generator, with the run's tokenizer and chat template."""

    cfg: object
    generator: object
    fmt: ChatFormat

    def replies(
        self,
        conversations: Sequence[list[dict]],
        max_new_tokens: int = 256,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """Reply token ids per conversation (the end-of-turn token excluded)."""
        prompts = [self.fit(c, max_new_tokens) for c in conversations]
        if top_k is not None:  # a tiny vocabulary may have fewer tokens than k
            top_k = min(top_k, self.cfg.model.vocab_size)
        outs = self.generator(
            prompts,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_ids=self.fmt.end_ids,
            on_token=on_token,
            pad_multiple=16,
        )
        return [[t for t in out if t not in self.fmt.end_ids] for out in outs]

    def fit(self, conversation: list[dict], max_new_tokens: int) -> list[int]:
        """The prompt for `conversation`, dropping its oldest exchanges (a user turn and the reply
        after it; never the system message or the newest turn) while prompt + reply would exceed the
        model's context. Only a newest turn longer than the context on its own is cut, to its end."""
        room = self.cfg.model.max_seq_len - max_new_tokens
        if room < 1:
            raise DataError(
                f"chat: --max-new-tokens {max_new_tokens} leaves no room for a prompt in "
                f"model.max_seq_len={self.cfg.model.max_seq_len}"
            )
        messages = list(conversation)
        while len(prompt := self.fmt.prompt(messages)) > room:
            oldest = next((i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None)
            if oldest is None:
                return prompt[-room:]
            del messages[oldest]
            if oldest < len(messages) - 1 and messages[oldest]["role"] == "assistant":
                del messages[oldest]
        return prompt

    def decode(self, ids: list[int]) -> str:
        return self.fmt.tok.decode(ids, skip_special_tokens=False)


def chat_model(
    cfg, params, tok_dir: Path, template: str | None = None, *, quantize: str | None = None, kv_dtype=None
) -> ChatModel:
    """A ChatModel over plain params; the template defaults to the one the run trained with.

    `quantize` ("int8": `model.quantize.quantize_params`) and `kv_dtype` (the KV cache's) as `Generator`.
    """
    import jax
    import jax.numpy as jnp

    from shipyard.inference.generate import Generator
    from shipyard.model.quantize import maybe_quantize
    from shipyard.run.model_dir import chat_format_of, run_template

    fmt = chat_format_of(tok_dir, template or run_template(cfg))
    params = maybe_quantize(jax.tree.map(jnp.asarray, params), cfg.model, quantize)
    return ChatModel(cfg, Generator(params, cfg.model, kv_dtype=kv_dtype), fmt)


def load_chat_model(
    model, step: int | None = None, template: str | None = None, *, quantize: str | None = None, kv_dtype=None
) -> ChatModel:
    """The run's newest (or `step`) checkpoint as a ChatModel (fine-tuning runs merged with their base)."""
    from shipyard.run.model_dir import ModelDir, open_model_dir

    model_dir = model if isinstance(model, ModelDir) else open_model_dir(model, "chat")
    cfg, _, params = model_dir.load(step, what="chat")
    tok_dir = model_dir.require_tokenizer("chat")
    return chat_model(cfg, params, tok_dir, template, quantize=quantize, kv_dtype=kv_dtype)


class TextStream:
    """Turns a growing list of token ids into newly printable text."""

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None]):
        self.decode, self.write = decode, write
        self.ids: list[int] = []
        self.shown = 0

    def on_token(self, end_ids: Sequence[int]) -> Callable[[int, int], None]:
        """A Generator on_token callback for one row that streams everything but the end tokens."""

        def push(_row: int, token: int) -> None:
            if token not in end_ids:
                self.push(token)

        return push

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its other bytes
            return
        if len(text) > self.shown:
            self.write(text[self.shown :])
            self.shown = len(text)


HELP = "commands: /reset (new conversation), /system TEXT (set the system message), /quit (or Ctrl-D)"


def run_chat(
    model: ChatModel,
    *,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_k: int | None = 50,
    top_p: float | None = 0.95,
    seed: int = 0,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] | None = None,
) -> int:
    """The interactive loop: read a user turn, stream the reply, keep the history."""

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write = write or out
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    write(f"shipyard chat ({model.fmt.template.name} template). {HELP}\n")
    turn = 0
    while True:
        try:
            line = read("you> ")
        except EOFError:
            write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            history = [m for m in history if m["role"] == "system"]
            write("(new conversation)\n")
            continue
        if text.startswith("/system"):
            history = [{"role": "system", "content": text[len("/system") :].strip()}]
            write("(system message set; new conversation)\n")
            continue
        if text.startswith("/"):
            write(f"unknown command {text.split()[0]}; {HELP}\n")
            continue
        history.append({"role": "user", "content": line})
        write("assistant> ")
        stream = TextStream(model.decode, write)
        reply = model.replies(
            [history],
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed + turn,
            on_token=stream.on_token(model.fmt.end_ids),
        )[0]
        write("\n")
        history.append({"role": "assistant", "content": model.decode(reply)})
        turn += 1
