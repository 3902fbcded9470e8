"""Chat exact match: greedy replies to each conversation's last assistant turn, compared with it."""

from __future__ import annotations

from pathlib import Path

from shipyard.data.chat_format import read_conversations
from shipyard.errors import DataError
from shipyard.inference.chat import ChatModel
from shipyard.output import progress


def exact_match(model: ChatModel, path: str | Path, batch: int = 32, max_new_tokens: int = 64) -> dict:
    """Greedy replies to every conversation's last assistant turn (given what precedes it), compared
    with the reference after stripping surrounding whitespace."""
    items = []
    for messages in read_conversations(path):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is not None:
            items.append((messages[:last], messages[last]["content"]))
    if not items:
        raise DataError(f"chat eval: {path} has no conversation with an assistant reply")
    hits, examples = 0, []
    bar = progress(total=len(items), desc=f"chat eval {Path(path).name}", unit="conv")
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        outs = model.replies([c for c, _ in chunk], max_new_tokens)
        bar.update(len(chunk))
        for (context, ref), out in zip(chunk, outs):
            got = model.decode(out)
            ok = got.strip() == ref.strip()
            hits += ok
            if len(examples) < 5:
                examples.append(
                    {"prompt": context[-1]["content"], "reference": ref, "reply": got, "match": ok}
                )
    bar.close()
    return {"conversations": len(items), "exact_match": hits / len(items), "examples": examples}
