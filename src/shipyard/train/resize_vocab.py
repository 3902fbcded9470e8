"""A base model's embedding and head resized to another tokenizer's vocabulary (train.resize_vocab).

Fine-tuning on a domain tokenizer: the run's `model.vocab_size` is the new
size, and its tokenizer (the run's data's) differs from the one the base
(`train.init_from`) was trained with. Rows are matched by token *string*
(tokenizer.json's vocabulary with its added and special tokens): a token both
vocabularies hold keeps its trained row, copied bitwise (and an untied head
its column); every other row (a new token, or padding past the new
tokenizer's size) starts at the mean of the base's rows of its own
tokenizer's tokens (the head's columns likewise), so a new token starts as
"an average token" rather than as noise the rest of the network never saw.

The plan is a pure function of the two tokenizer files and the two sizes,
and the resize a gather plus one mean, so every read of the base gives the
same params bitwise. `VocabPlan.summary` is the run's start-up line and
`record_plan` puts the counts into provenance.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shipyard.data.tokenizer import load_tokenizer, tokenizer_sha256
from shipyard.model.transformer import TransformerParams
from shipyard.output import write_atomic


@dataclass(frozen=True)
class VocabPlan:
    """Where each row of the resized embedding comes from."""

    old_tokenizer: Path
    """The base's tokenizer (train.init_from's)."""
    new_tokenizer: Path
    """The run's tokenizer."""
    old_size: int
    """The base's model.vocab_size."""
    new_size: int
    """The run's model.vocab_size."""
    source: np.ndarray
    """int32 [new_size]: the base row new row i copies, or -1 for the mean row."""
    mean_rows: np.ndarray
    """int32: the base rows the mean is taken over (the ids of the base tokenizer's tokens)."""
    new_tokens: int
    """Ids of the run's tokenizer (below new_size); the rest of the rows are padding."""
    dropped: int
    """Tokens of the base's tokenizer the run's does not hold (their rows are left behind)."""

    @property
    def copied(self) -> int:
        return int((self.source >= 0).sum())

    @property
    def fresh(self) -> int:
        """Rows that start at the mean: the new tokenizer's unknown tokens plus padding."""
        return self.new_size - self.copied

    def summary(self) -> str:
        padding = self.new_size - self.new_tokens
        pad = f"; {padding} of them padding past the tokenizer's {self.new_tokens} tokens" if padding else ""
        return (
            f"resized the vocabulary {self.old_size} -> {self.new_size}: {self.copied} rows copied, "
            f"{self.fresh} new (mean embedding{pad})"
        )

    def record(self) -> dict:
        """What provenance.json keeps of the resize."""
        return {
            "from_tokenizer": {
                "path": str(self.old_tokenizer),
                "sha256": tokenizer_sha256(self.old_tokenizer),
            },
            "to_tokenizer": {"path": str(self.new_tokenizer), "sha256": tokenizer_sha256(self.new_tokenizer)},
            "from_vocab_size": self.old_size,
            "to_vocab_size": self.new_size,
            "rows_copied": self.copied,
            "rows_new": self.fresh,
            "padding_rows": self.new_size - self.new_tokens,
            "base_tokens_dropped": self.dropped,
        }


def token_vocab(tokenizer_dir: Path) -> dict[str, int]:
    """token string -> id of a tokenizer.json, added and special tokens included."""
    return load_tokenizer(tokenizer_dir).get_vocab(with_added_tokens=True)


def vocab_mismatch(old: dict[str, int], new: dict[str, int]) -> str | None:
    """Why ids of the `new` vocabulary would not mean what the base learned (None: they do, i.e.
    every token of `new` has the same id in `old`): an example token and how many differ."""
    moved = sorted((i, t) for t, i in new.items() if old.get(t) != i)
    if not moved:
        return None
    i, t = moved[0]
    there = "absent" if t not in old else f"id {old[t]}"
    return f"{len(moved)} of its {len(new)} tokens are new or have other ids, e.g. id {i} is {t!r} here, {there} there"


def plan_resize(old_tokenizer: Path, new_tokenizer: Path, old_size: int, new_size: int) -> VocabPlan:
    """The row mapping from the base's vocabulary (`old_size` rows) to the run's (`new_size`)."""
    old, new = token_vocab(old_tokenizer), token_vocab(new_tokenizer)
    source = np.full(new_size, -1, np.int32)
    for token, i in new.items():
        j = old.get(token)
        if i < new_size and j is not None and j < old_size:
            source[i] = j
    mean_rows = np.array(sorted(j for j in old.values() if j < old_size), np.int32)
    if not len(mean_rows):  # a base tokenizer with no id inside the base's vocabulary: all its rows
        mean_rows = np.arange(old_size, dtype=np.int32)
    return VocabPlan(
        old_tokenizer,
        new_tokenizer,
        old_size,
        new_size,
        source,
        mean_rows,
        new_tokens=min(max(new.values(), default=-1) + 1, new_size),
        dropped=sum(1 for t in old if t not in new),
    )


def fitted(sharding, shape: tuple[int, ...]):
    """`sharding` for an array of `shape`: mesh axes that do not divide a dimension dropped from it
    (the base's vocabulary axis may not divide where the run's does)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))

    def size(axes) -> int:
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([sharding.mesh.shape[a] for a in names if a is not None]))

    spec = [a if a is None or n % size(a) == 0 else None for a, n in zip(spec, shape)]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _rows(table: jax.Array, source: jax.Array, mean_rows: jax.Array, axis: int) -> jax.Array:
    """`table`'s slices along `axis` picked by `source`; index -1 gives the mean over `mean_rows`."""
    mean = jnp.mean(jnp.take(table, mean_rows, axis=axis), axis=axis, keepdims=True)
    extended = jnp.concatenate([table, mean.astype(table.dtype)], axis=axis)
    # -1 -> the appended mean slice; every other index copies its slice unchanged (a gather is exact)
    index = jnp.where(source < 0, table.shape[axis], source)
    return jnp.take(extended, index, axis=axis)


def resize_params(params: TransformerParams, plan: VocabPlan, shardings=None) -> TransformerParams:
    """The base's `params` with embed [V, E] (and an untied lm_head [E, V]) resized by `plan`, placed
    on `shardings` (the run's; None: left where jit puts them). Every other leaf is passed through."""
    source, mean_rows = jnp.asarray(plan.source), jnp.asarray(plan.mean_rows)

    def resize(table, axis, sharding):
        fn = jax.jit(_rows, static_argnums=3, out_shardings=sharding)
        return fn(table, source, mean_rows, axis)

    embed = resize(params.embed, 0, None if shardings is None else shardings.embed)
    head = params.lm_head
    if head is not None:
        head = resize(head, 1, None if shardings is None else shardings.lm_head)
    return replace(params, embed=embed, lm_head=head)


def record_plan(run_dir: Path, plan: VocabPlan) -> None:
    """Add the resize to the run's provenance.json (written by the run header just before)."""
    path = run_dir / "provenance.json"
    try:
        prov = json.loads(path.read_text())
    except (OSError, ValueError):
        prov = {}
    prov["vocab_resize"] = plan.record()
    write_atomic(path, json.dumps(prov, indent=2) + "\n")
