"""Driving the continuous-batching engine from a test: submit requests, wait for every one to end."""

from __future__ import annotations

import threading

from shipyard.inference.engine import Engine, Request


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
