"""Driving the continuous-batching engine from a test: submit requests, wait for every one to end."""

from __future__ import annotations

import threading

from shipyard.inference.engine import Engine, Request, Sampling, engine_for


def run_requests(engine: Engine, prompts, sampling, timeout: float = 120) -> list[tuple[list[int], str]]:
    """Submit everything at once (more requests than slots is fine); (tokens, finish) per request."""
    results: dict[int, tuple[list[int], str]] = {}
    done = threading.Event()

    def collect(i):
        acc: list[int] = []

        def on_tokens(tokens, _logprobs, finish):
            acc.extend(tokens)
            if finish:
                results[i] = (acc, finish)
                if len(results) == len(prompts):
                    done.set()

        return on_tokens

    for i, (p, s) in enumerate(zip(prompts, sampling, strict=True)):
        engine.submit(Request(p, s, collect(i)))
    assert done.wait(timeout), f"{len(prompts) - len(results)} of {len(prompts)} requests did not finish"
    return [results[i] for i in range(len(prompts))]


def complete(
    engine: Engine, prompts, max_tokens: int, *, stop=None, on_token=None, **sampling
) -> list[list[int]]:
    """New tokens per prompt through `Engine.generate` (the client every command uses); `sampling` are
    `Sampling` fields (temperature, top_k, top_p, seed, stop_ids)."""
    settings = Sampling(max_tokens=max_tokens, **sampling)
    return [list(c.tokens) for c in engine.generate(prompts, settings, stop=stop, on_token=on_token)]


def generate(params, cfg, prompts, max_tokens: int, *, engine_options=None, **sampling) -> list[list[int]]:
    """`complete` on a fresh engine sized for these prompts, as `shipyard generate` builds one."""
    engine = engine_for(params, cfg, prompts, max_tokens, **(engine_options or {}))
    return complete(engine, prompts, max_tokens, **sampling)
