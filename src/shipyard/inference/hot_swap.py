"""New weights for a running server: an admin call or a watched run swaps them in, nothing is dropped.

`Swapper.swap_to(model, step)` loads any model directory (a run's checkpoint, a
LoRA run: its adapters folded into the base, an import, an HF directory) the
way `shipyard serve` loaded the first one (the same `--tokenizer` and
`--quantize`), refuses one that is not the served model's kind in one line
(another architecture or size, another tokenizer), and hands the weights to
`Engine.swap`: requests queued before finish on the old weights, those queued
after run on the new ones. Every response names the weights that produced it
in `system_fingerprint` (`fingerprint`: a hash of the served arrays' bytes, so
the same weights reached by two paths have one fingerprint).

`Swapper.watch(run, every)` polls a run directory (a training run writing
checkpoints) and swaps to its newest checkpoint once that checkpoint's sha256
sidecar is written and matches (`checkpoint.verified`): a checkpoint still
being saved or hashed, or a damaged one, is never served.

One swap runs at a time; a second one asked for meanwhile is refused (409),
not queued.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from pathlib import Path

import jax
import numpy as np

from shipyard.errors import ShipyardError

log = logging.getLogger("shipyard.serve")


class SwapRefused(ShipyardError):
    """The weights asked for cannot replace the served ones (the old ones keep serving)."""


class SwapBusy(ShipyardError):
    """Another swap is running."""


def fingerprint(params) -> str:
    """`fp_` and 24 hex digits of the sha256 over every array of `params` (its place in the tree,
    dtype, shape and bytes, in tree order): what `system_fingerprint` reports."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return "fp_" + h.hexdigest()[:24]


def tokenizer_digest(tok_dir: Path) -> str:
    """sha256 of a tokenizer directory's tokenizer.json (two models speak the same ids iff equal)."""
    return hashlib.sha256((Path(tok_dir) / "tokenizer.json").read_bytes()).hexdigest()


def _key(model: str | Path) -> str:
    """A model's name for comparing sources: a local directory's resolved path, a URL as it is."""
    return str(model) if "://" in str(model) else str(Path(model).resolve())


def _first_difference(served, other) -> str | None:
    """`field: theirs where the served model has mine` for the first field of two ModelConfigs that differs."""
    for name in type(served).model_fields:  # a pydantic Schema
        mine, theirs = getattr(served, name), getattr(other, name)
        if mine != theirs:
            return f"model.{name} is {theirs!r} where the served model has {mine!r}"
    return None


@dataclasses.dataclass
class Swapper:
    """Loads weights into a running engine (see the module docstring); one per server."""

    engine: object
    """The started `Engine` serving them."""
    model: str
    """The model directory the served weights came from."""
    step: int | None
    """Their checkpoint step (None for an import or an HF directory)."""
    tokenizer: Path | None = None
    """`--tokenizer`, used for every model swapped in, as at start-up."""
    quantize: str | None = None
    """`--quantize`, applied to every model swapped in, as at start-up."""
    tokenizer_sha256: str = ""
    """`tokenizer_digest` of the served model's tokenizer: a swap must speak the same ids."""
    counts: dict = dataclasses.field(default_factory=lambda: {"ok": 0, "refused": 0})
    """Swaps done and refused so far (GET /metrics)."""

    def __post_init__(self):
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bad: set[tuple[str, int]] = set()  # checkpoints `watch` found damaged (said once)

    def swap_to(self, model: str | Path, step: int | None = None) -> dict:
        """Serve `model` (checkpoint `step`, default its newest) from now on; waits until the requests
        ahead of the swap have ended. Raises SwapRefused (nothing changed) or SwapBusy."""
        if not self._lock.acquire(blocking=False):
            raise SwapBusy("another swap is running; ask again once it has finished")
        try:
            t0 = time.perf_counter()
            try:
                params, step = self._load(model, step)
                new = fingerprint(params)
                if new != self.engine.fingerprint:
                    self.engine.swap(params, new)
            except (ShipyardError, ValueError) as e:  # model_dir's errors already begin "swap: "
                self.counts["refused"] += 1
                raise SwapRefused(str(e) if isinstance(e, ShipyardError) else f"swap: {e}") from e
            old, self.model, self.step = self.model, _key(model), step
            self.counts["ok"] += 1
            seconds = time.perf_counter() - t0
            log.info(
                "swapped weights: %s (step %s) -> %s (step %s), %s, %.1fs",
                old,
                self.step,
                model,
                step,
                new,
                seconds,
            )
            return {"fingerprint": new, "model": str(model), "step": step, "seconds": round(seconds, 3)}
        finally:
            self._lock.release()

    def _load(self, model, step):
        from shipyard.model.quantize import maybe_quantize
        from shipyard.run.model_dir import open_model_dir

        model_dir = open_model_dir(model, "swap", self.tokenizer)
        problem = _first_difference(self.engine.cfg, model_dir.config.model)
        if problem is not None:
            raise SwapRefused(
                f"swap: {model} is another model ({problem}); it cannot replace the served weights"
            )
        digest = tokenizer_digest(model_dir.require_tokenizer("swap"))
        if self.tokenizer_sha256 and digest != self.tokenizer_sha256:
            raise SwapRefused(
                f"swap: {model} speaks another tokenizer (its tokenizer.json differs from the served model's); "
                "a swap keeps the tokenizer: start a new server for it"
            )
        cfg, step, params = model_dir.load(step, what="swap")
        return maybe_quantize(params, cfg.model, self.quantize), step

    def newest_verified(self, run: str | Path) -> int | None:
        """The newest checkpoint of `run` whose sha256 sidecar is written and matches, or None."""
        from shipyard.run.checkpoint import checkpoint_dir, verified
        from shipyard.run.model_dir import open_model_dir

        model_dir = open_model_dir(run, "serve --watch")
        if model_dir.kind != "run":
            raise SwapRefused(f"serve --watch: {run} is not a run directory (it has no checkpoints to watch)")
        for step in model_dir.steps:
            if (str(run), step) in self._bad:
                continue
            problem = verified(checkpoint_dir(model_dir.path), step)
            if problem is None:
                return step
            if problem != "not hashed yet":
                log.warning("serve --watch: checkpoint %d of %s is not served: %s", step, run, problem)
                self._bad.add((str(run), step))
        return None

    def watch(self, run: str | Path, every: float) -> threading.Thread:
        """Poll `run` every `every` seconds in a daemon thread and swap to its newest verified
        checkpoint each time a newer one appears; problems are logged, the server keeps serving."""

        # a checkpoint newer than the last one seen is swapped in (so an admin swap to another model
        # stands until training writes a new checkpoint)
        seen = [self.step if _key(run) == _key(self.model) else None]

        def loop():
            while not self._stop.is_set():
                previous = seen[0]
                try:
                    step = self.newest_verified(run)
                    if step is not None and (previous is None or step > previous):
                        seen[0] = step  # a refused checkpoint is said once, not retried every poll
                        self.swap_to(run, step)
                except SwapBusy:
                    seen[0] = previous  # an admin swap is running: try again at the next poll
                except ShipyardError as e:
                    log.warning("%s", e)
                except Exception:  # a poll that fails must not end the watching
                    log.exception("serve --watch: polling %s failed", run)
                self._stop.wait(every)

        thread = threading.Thread(target=loop, name="shipyard-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """End `watch`."""
        self._stop.set()
