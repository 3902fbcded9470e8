"""Chat data for supervised fine-tuning: templates, rendering with an assistant-only loss mask, packing.

A conversation is a list of messages {role: system|user|assistant, content}.
A template turns it into pieces: the template's special tokens (looked up by
id, never parsed out of text) and text. Message contents are encoded on their
own with special-token parsing off (shipyard's tokenizers always are), so a
user who types "<|assistant|>" gets those characters, not a role switch.

The loss covers what the model must learn to produce: every assistant
message's content and the end-of-turn token that closes it (so the model
learns to stop); system and user turns, role headers and padding are context.

Template `hf` is the tokenizer's own Jinja chat template (data/hf_template.py),
rendered as transformers renders it: there the special tokens are written in
the text and parsed by the tokenizer, as `apply_chat_template` does, and the
mask is derived from the rendering (the same rule: content + end-of-turn).

Packing puts several conversations into one training sequence. Each keeps
its own segment id (attention never crosses into another conversation) and
its own positions starting at 0, so a packed conversation trains exactly as
it would alone (tested against the unpacked logits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shipyard.data.hf_template import HFChat, HFTemplate, load_hf_template
from shipyard.errors import DataError

ROLES = ("system", "user", "assistant")
BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")
"""The arrays of an SFT batch: tokens [B, L+1]; loss mask, segment ids, positions [B, L]."""


@dataclass(frozen=True)
class Template:
    """How one chat format lays out a conversation; pieces are ("special", token) or ("text", str)."""

    name: str
    bos: str | None
    """Special token that opens a conversation (None: nothing)."""
    header: tuple[tuple[str, str], ...]
    """Pieces before a message's content, with "{role}" in text pieces replaced by the role."""
    end: str
    """Special token that closes every message (the stop token when generating)."""
    after_end: str = ""
    """Text after the end token (not trained: it belongs to the next turn's context)."""
    role_tokens: bool = False
    """The header is one special token per role, <|role|> (shipyard's format)."""

    def header_pieces(self, role: str) -> list[tuple[str, str]]:
        if self.role_tokens:
            return [("special", f"<|{role}|>")]
        return [(kind, text.replace("{role}", role)) for kind, text in self.header]

    def specials(self) -> set[str]:
        names = {self.end} | ({self.bos} if self.bos else set())
        names |= {t for r in ROLES for kind, t in self.header_pieces(r) if kind == "special"}
        return names


TEMPLATES = {
    "shipyard": Template("shipyard", "<|bos|>", (), "<|end|>", role_tokens=True),
    "chatml": Template(
        "chatml", None, (("special", "<|im_start|>"), ("text", "{role}\n")), "<|im_end|>", "\n"
    ),
    "llama3": Template(
        "llama3",
        "<|begin_of_text|>",
        (
            ("special", "<|start_header_id|>"),
            ("text", "{role}"),
            ("special", "<|end_header_id|>"),
            ("text", "\n\n"),
        ),
        "<|eot_id|>",
    ),
}


def pick_template(name: str, tok, tok_path: str | Path | None = None) -> Template | HFTemplate:
    """The named template; "hf" is the tokenizer's own chat template (from the tokenizer directory
    `tok_path`); "auto" is that one when the directory has it, else the first built-in template whose
    special tokens the tokenizer has."""
    if name == "hf" or (name == "auto" and tok_path is not None):
        hf = load_hf_template(tok_path) if tok_path is not None else None
        if hf is not None:
            return hf
        if name == "hf":
            where = f"{tok_path} has none" if tok_path is not None else "no tokenizer directory was given"
            raise DataError(
                f"data.chat.template: hf needs the tokenizer's own chat template, and {where} (no chat_template "
                "in tokenizer_config.json, no chat_template.jinja); use shipyard, chatml or llama3"
            )
    vocab = tok.get_vocab(with_added_tokens=True)
    if name != "auto":
        missing = sorted(t for t in TEMPLATES[name].specials() if t not in vocab)
        if missing:
            raise DataError(
                f"data.chat.template: {name} needs the special tokens {missing}, which the tokenizer lacks"
            )
        return TEMPLATES[name]
    for template in TEMPLATES.values():
        if template.specials() <= set(vocab):
            return template
    raise DataError(
        "data.chat.template: auto found no chat template whose special tokens the tokenizer has "
        f"(tried {', '.join(TEMPLATES)}); train a tokenizer with shipyard's defaults (<|user|>, <|assistant|>, "
        "<|end|>, ...) or use one with chatml or Llama-3 tokens"
    )


class ChatFormat:
    """A tokenizer plus a template: renders conversations to token ids and loss masks."""

    def __init__(self, tok, template: Template | HFTemplate):
        self.tok, self.template = tok, template
        self._hf = HFChat(tok, template) if isinstance(template, HFTemplate) else None
        if self._hf is not None:
            self.end_ids = self._hf.end_ids
        else:
            self._ids = {t: tok.token_to_id(t) for t in template.specials()}
            self.end_ids = (self._ids[template.end],)
        self.end_id = self.end_ids[0]
        """The end-of-turn token (the stop token when generating); `end_ids` also holds the tokenizer's eos for hf."""

    def _pieces(self, pieces, trained: bool, ids: list[int], mask: list[int]) -> None:
        for kind, text in pieces:
            new = (
                [self._ids[text]]
                if kind == "special"
                else self.tok.encode(text, add_special_tokens=False).ids
            )
            ids.extend(new)
            mask.extend([int(trained)] * len(new))

    def render(self, messages: list[dict], generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token is trained) of a conversation; with `generation_prompt` it ends
        with the assistant header, ready for the model to write the next reply."""
        if self._hf is not None:
            return self._hf.render(messages, generation_prompt)
        t = self.template
        ids: list[int] = []
        mask: list[int] = []
        if t.bos is not None:
            self._pieces([("special", t.bos)], False, ids, mask)
        for m in messages:
            assistant = m["role"] == "assistant"
            self._pieces(t.header_pieces(m["role"]), False, ids, mask)
            self._pieces([("text", m["content"])] if m["content"] else [], assistant, ids, mask)
            self._pieces([("special", t.end)], assistant, ids, mask)
            if t.after_end:
                self._pieces([("text", t.after_end)], False, ids, mask)
        if generation_prompt:
            self._pieces(t.header_pieces("assistant"), False, ids, mask)
        return ids, mask

    def prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The ids of the conversation and the generation prompt (the assistant header). `tools` (the
        functions the model may call) only with a template that renders them (an HF one)."""
        if self._hf is not None:
            return self._hf.prompt(messages, tools)
        if tools:
            raise ValueError(f"the {self.template.name} chat template has no way to show tools to the model")
        return self.render(messages, generation_prompt=True)[0]

    @property
    def source(self) -> str | None:
        """The Jinja source of an HF template (None for a built-in one)."""
        return self.template.source if self._hf is not None else None


def check_messages(messages, where: str) -> list[dict]:
    """The messages of one conversation, validated: a non-empty list of {role, content} with known roles."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i} content must be a string")
    return messages


def read_jsonl_records(path: str | Path, section: str, expected: str, check, nothing: str) -> list:
    """The callable `check` applied as check(record, where) to every line of a JSONL file (blank lines skipped), `where` naming the
    config section, file and line for its one-line errors; a missing file, a line that is not JSON
    or a file with no records is a DataError (`expected` describes a line, `nothing` the records)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{section}: {path} does not exist (expected a JSONL file of {expected})")
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{section}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{section}: {path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from e
        out.append(check(record, where))
    if not out:
        raise DataError(f"{section}: {path} holds no {nothing}")
    return out


def _conversation(record, where: str) -> list[dict]:
    if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f"{where}: expected an object with a 'messages' list")
    return check_messages(record["messages"], where)


def read_conversations(path: str | Path) -> list[list[dict]]:
    """Every conversation of a JSONL file ({"messages": [...]} per line; blank lines skipped)."""
    return read_jsonl_records(path, "data.chat", '{"messages": [...]}', _conversation, "conversations")


@dataclass(frozen=True)
class PackedChats:
    """Training rows: tokens [N, L+1]; per input position [N, L]: loss mask, segment id, position."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    conversations: int
    """Conversations placed in the rows."""
    dropped: int
    """Conversations longer than L+1 tokens (or with nothing to train on), left out."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def fill(self) -> float:
        """Fraction of the rows' input positions holding real tokens."""
        return float(np.mean(self.segment_ids >= 0))

    def rows(self, idx: list[int]) -> dict[str, np.ndarray]:
        """The batch arrays (BATCH_KEYS) of rows `idx`."""
        return {k: getattr(self, k)[idx] for k in BATCH_KEYS}


_OPEN_ROWS = 16


def pack(
    rendered: list[tuple[list[int], list[int]]],
    seq_len: int,
    pad_id: int,
    seed: int | None,
    pack: bool = True,
) -> PackedChats:
    """Place rendered conversations into rows of seq_len + 1 tokens.

    Order: a seeded permutation (None keeps file order); each conversation goes
    into the first of the newest few rows where it fits, else starts a new one
    (one per row when `pack` is false). Padding is pad_id with segment -1 and
    no loss.
    """
    width = seq_len + 1
    keep = [i for i, (ids, mask) in enumerate(rendered) if len(ids) <= width and any(mask[1:])]
    dropped = len(rendered) - len(keep)
    if not keep:
        raise DataError(
            f"data.chat: none of the {len(rendered)} conversations fits in data.seq_len + 1 = {width} tokens "
            "with an assistant reply to train on; raise data.seq_len"
        )
    sizes = {i: len(rendered[i][0]) for i in keep}
    rows = place(sizes, seeded_order(keep, seed), width, pack)
    arrays = fill_rows([[rendered[i] for i in members] for members in rows], width, pad_id)
    return PackedChats(**arrays, conversations=len(keep), dropped=dropped)


def seeded_order(keep: list[int], seed: int | None) -> list[int]:
    """`keep` in a seeded permutation (None: as it is)."""
    return keep if seed is None else [keep[i] for i in np.random.default_rng(seed).permutation(len(keep))]


def place(sizes: dict[int, int], order: list[int], width: int, pack: bool) -> list[list[int]]:
    """Bounded first-fit: each item (of `sizes[i]` tokens, in `order`) into the first of the newest
    few rows of `width` with room, else a new row; one item per row when `pack` is false."""
    rows: list[list[int]] = []
    used: list[int] = []
    open_rows: list[int] = []  # the newest rows with room: bounded first-fit, linear in the data
    for i in order:
        home = next((r for r in open_rows if used[r] + sizes[i] <= width), None) if pack else None
        if home is None:
            rows.append([])
            used.append(0)
            home = len(rows) - 1
            open_rows = (open_rows + [home])[-_OPEN_ROWS:]
        rows[home].append(i)
        used[home] += sizes[i]
    return rows


def fill_rows(
    rows: list[list[tuple[list[int], list[int]]]], width: int, pad_id: int
) -> dict[str, np.ndarray]:
    """The arrays of packed rows, each a list of sequences (token ids, 1 where trained): tokens [N, width];
    per input position loss_mask, segment_ids (a sequence's index in its row; -1 padding) and positions
    (from 0 per sequence). Padding is pad_id with no loss."""
    n = len(rows)
    tokens = np.full((n, width), pad_id, np.int32)
    trained = np.zeros((n, width), np.int32)
    seg = np.full((n, width), -1, np.int32)
    pos = np.zeros((n, width), np.int32)
    for r, sequences in enumerate(rows):
        at = 0
        for s, (ids, mask) in enumerate(sequences):
            tokens[r, at : at + len(ids)] = ids
            trained[r, at : at + len(ids)] = mask
            seg[r, at : at + len(ids)] = s
            pos[r, at : at + len(ids)] = np.arange(len(ids))
            at += len(ids)
    # target t+1 is trained when it is a trained token of the same sequence as input t
    loss_mask = (trained[:, 1:] == 1) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask.astype(np.float32),
        "segment_ids": seg[:, :-1],
        "positions": pos[:, :-1],
    }


def pad_id_of(tok_path: Path, tok) -> int:
    from shipyard.data.tokenizer import special_token_ids

    ids = special_token_ids(tok_path, tok)
    return ids["pad_token"] if ids["pad_token"] is not None else ids["eos_token"]


class ChatBatchLoader:
    """Rows of the global SFT batch for any step: packed rows, shuffled per epoch by Grain (a pure
    function of seed and step, like the pretraining loader, so resume needs only the step)."""

    keys: tuple[str, ...] = BATCH_KEYS
    """The batch arrays `packed.rows` gives."""

    def __init__(self, packed, batch_size: int, seed: int):
        import grain

        self.packed, self.batch_size = packed, batch_size
        self.order = grain.MapDataset.source(list(range(len(packed)))).shuffle(seed=seed).repeat()

    @property
    def row_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of one row of each batch array (what `loader.device_batch` builds)."""
        return {k: getattr(self.packed, k).shape[1:] for k in self.keys}

    def row_indices(self, step: int, lo: int = 0, hi: int | None = None) -> list[int]:
        """Which packed rows rows lo..hi of step's batch are."""
        hi = self.batch_size if hi is None else hi
        return [self.order[step * self.batch_size + r] for r in range(lo, hi)]

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        return self.packed.rows(self.row_indices(step, lo, hi))
