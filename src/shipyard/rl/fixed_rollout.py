"""Fixed-shape rollouts (rl.fixed_shape): replies sampled from the trainer's own log-prob program.

The engine's rollouts agree with the trainer to a few ulps: its prefill and one-token decode steps
are other programs than the trainer's forward over whole sequences, and XLA rounds each in its own
order. Here every token is drawn from `step.make_distribution`'s program, the one the trainer's
log-probs come from, run at one shape: [rows, length] with each row's prompt and reply so far
left-aligned and zeros after. The causal mask makes a position's log-probs independent of what
lies after it (those keys weigh exactly 0), and each row's of the other rows, so the log-prob a
token was drawn with is bit for bit the one the trainer computes for it later, in whichever row
of its batch (tests/test_rl.py checks it with `array_equal`).

The price: no KV cache, so each token recomputes every row's whole sequence (rows x length tokens
per token drawn). The draw itself happens on the host, from the token's probabilities in float64,
with a NumPy generator seeded per reply: a function of (seed, step, prompt, sample) as the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shipyard.config import RLConfig
from shipyard.rl.rollout import Group, Reply, finish_reply


def sample_fixed(
    distribution: Callable,
    items: Sequence[dict],
    prompts: Sequence[Sequence[int]],
    *,
    rl: RLConfig,
    rows: int,
    length: int,
    replies: int,
    seeds: Callable[[int, int], int],
    stop_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
    reward: Callable[[str, str, dict], float],
) -> list[Group]:
    """`replies` replies to each prompt, drawn from `distribution(tokens [rows, length]) -> log-probs
    [rows, length-1, V]` (the trainer's program with its params bound), scored by `reward`."""
    n = len(prompts) * replies
    if n > rows:
        raise ValueError(f"{len(prompts)} prompts x {replies} replies exceed the {rows} rows")
    tokens = np.zeros((rows, length), np.int32)
    at = np.zeros(rows, np.int64)  # the slot the row's next token goes to
    for r in range(n):
        prompt = prompts[r // replies]
        tokens[r, : len(prompt)] = prompt
        at[r] = len(prompt)
    draws = [np.random.default_rng(seeds(r // replies, r % replies)) for r in range(n)]
    got: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    running = set(range(n))
    while running:
        every = np.asarray(distribution(tokens))
        for r in sorted(running):
            logp = every[r, at[r] - 1]
            p = np.exp(logp.astype(np.float64))
            token = int(draws[r].choice(p.size, p=p / p.sum()))
            tokens[r, at[r]] = token
            at[r] += 1
            got[r].append(token)
            logps[r].append(float(logp[token]))
            if token in stop_ids or len(got[r]) >= rl.max_tokens or at[r] >= length:
                running.discard(r)
    groups = []
    for i, (item, ids) in enumerate(zip(items, prompts)):
        out: list[Reply] = []
        for r in range(i * replies, (i + 1) * replies):
            out.append(
                finish_reply(item, got[r], logps[r], rl=rl, stop_ids=stop_ids, decode=decode, reward=reward)
            )
        groups.append(Group(item, tuple(ids), tuple(out)))
    return groups
