"""Rollouts: G replies to each prompt from the serving engine, their rewards, and the fixed-shape batch
the trainer steps on (rl/step.py).

The engine is `inference.engine.Engine` with `sampling_logprobs`: each reply token comes with its
log-prob under the distribution it was drawn from (temperature, top-k, top-p applied), the number
the importance ratio divides by. The G requests of a prompt are submitted together, so they share
one prefill (`Engine._start` prefills each distinct prompt once). Every reply's seed is a function
of (run seed, step, prompt, sample): a resumed run draws the same replies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from shipyard.config import RLConfig
from shipyard.inference.engine import Engine
from shipyard.inference.sampling import Sampling
from shipyard.rl.tasks import prompt_text


@dataclasses.dataclass(frozen=True)
class Reply:
    """One sampled reply."""

    tokens: tuple[int, ...]
    """The reply's tokens (the end-of-sequence token included when it ended so)."""
    logps: tuple[float, ...]
    """Each token's log-prob under the sampling distribution (the engine's)."""
    text: str
    """The reply decoded (without the end token), what the reward reads."""
    overlong: bool
    """Cut at max_tokens without ending."""
    reward: float
    """The reward after the overlong rule."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A prompt and its G replies."""

    item: dict
    """The prompt's item (its text and the fields its reward reads)."""
    prompt: tuple[int, ...]
    """The prompt's token ids."""
    replies: tuple[Reply, ...]

    def rewards(self) -> np.ndarray:
        return np.array([r.reward for r in self.replies], np.float32)


def reply_seed(seed: int, step: int, prompt: int, sample: int, stream: int = 0) -> int:
    """The PRNG seed of one reply: a pure function of where it is in the run (int32). `stream` tells
    a step's draws apart (0 the batch, 100 + r refill round r, 1 and 2 the held-out evaluation's):
    apart in the entropy, not added to the seed, so no draw repeats another seed's."""
    mixed = np.random.default_rng([seed, step, prompt, sample, *([stream] if stream else [])])
    return int(mixed.integers(0, 2**31 - 1))


def sample_groups(
    engine: Engine,
    items: Sequence[dict],
    prompts: Sequence[Sequence[int]],
    *,
    rl: RLConfig,
    replies: int,
    temperature: float,
    seeds: Callable[[int, int], int],
    stop_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
    reward: Callable[[str, str, dict], float],
) -> list[Group]:
    """`replies` replies to each prompt (one engine call for all: the samples of a prompt share its
    prefill), scored by `reward`; `seeds(i, g)` seeds reply g of prompt i."""
    requests, samplings = [], []
    for i, ids in enumerate(prompts):
        for g in range(replies):
            requests.append(list(ids))
            samplings.append(
                Sampling(
                    max_tokens=rl.max_tokens,
                    temperature=temperature,
                    top_k=rl.top_k,
                    top_p=rl.top_p,
                    seed=seeds(i, g),
                    stop_ids=stop_ids,
                    logprobs=temperature > 0,
                )
            )
    done = engine.generate(requests, samplings)
    groups = []
    for i, (item, ids) in enumerate(zip(items, prompts)):
        out = [
            finish_reply(
                item, c.tokens, c.logprobs or (), rl=rl, stop_ids=stop_ids, decode=decode, reward=reward
            )
            for c in done[i * replies : (i + 1) * replies]
        ]
        groups.append(Group(item, tuple(ids), tuple(out)))
    return groups


def finish_reply(
    item: dict,
    tokens: Sequence[int],
    logps: Sequence[float],
    *,
    rl: RLConfig,
    stop_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
    reward: Callable[[str, str, dict], float],
) -> Reply:
    """A sampled reply to `item` decoded and scored (the overlong rule applied)."""
    ended = bool(tokens) and tokens[-1] in stop_ids
    text = decode(list(tokens[:-1] if ended else tokens))
    overlong = not ended and len(tokens) >= rl.max_tokens
    value = reward(prompt_text(item), text, item)
    if overlong and rl.overlong == "penalty":
        value += rl.overlong_penalty
    return Reply(tuple(tokens), tuple(logps), text, overlong, value)


def informative(group: Group) -> bool:
    """Whether the group's rewards differ (equal rewards give every reply advantage 0)."""
    r = group.rewards()
    return bool(np.any(r != r[0]))


def build_batch(
    groups: Sequence[Group], advantages: np.ndarray, rows: int, length: int, rl: RLConfig
) -> dict:
    """The trainer's batch (rl/step.py) of `groups` padded to `rows` replies of `length` tokens;
    `advantages` [groups, G]. Overlong replies are left out of the loss with rl.overlong: mask."""
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length - 1), np.float32)
    old = np.zeros((rows, length - 1), np.float32)
    adv = np.zeros(rows, np.float32)
    r = 0
    for group, group_adv in zip(groups, advantages):
        p = len(group.prompt)
        for reply, a in zip(group.replies, group_adv):
            n = len(reply.tokens)
            tokens[r, :p] = group.prompt
            tokens[r, p : p + n] = reply.tokens
            if not (reply.overlong and rl.overlong == "mask"):
                mask[r, p - 1 : p - 1 + n] = 1.0  # position t predicts token t + 1
                old[r, p - 1 : p - 1 + n] = reply.logps
            adv[r] = a
            r += 1
    return {"tokens": tokens, "mask": mask, "old_logp": old, "advantages": adv}


def pass_at(groups: Sequence[Group], threshold: float = 1.0) -> float:
    """The fraction of groups with a reply whose reward reaches `threshold` (pass@G of G replies)."""
    if not groups:
        return 0.0
    return float(np.mean([any(r.reward >= threshold for r in g.replies) for g in groups]))
