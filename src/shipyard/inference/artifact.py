"""Run a StableHLO artifact (`shipyard export stablehlo`) without building the model.

An artifact directory holds two serialized `jax.export` programs, the
weights they take as arguments, the tokenizer and `manifest.json`:

- `prefill.stablehlo`: (weights, tokens [batch, p], start [batch], seed,
  temperature, top_k, top_p) -> (first new token [batch], k, v, key [batch]:
  every row keyed by `seed`, as an engine request with that seed is). The
  prompts are left-padded to a common length p (any 1 <= p <= max_len: the
  prompt length is a symbolic dimension); `start[b]` is row b's number of pad
  slots. It fills a fresh cache of max_len slots.
- `decode.stablehlo`: (weights, token [batch], k, v, pos, start, key, steps,
  temperature, top_k, top_p) -> (tokens [chunk, batch], last token [batch],
  k, v, key): `steps` (<= chunk) decode steps from cache slot `pos`, each
  choosing its token on the device.

Sampling settings are traced inputs: temperature 0 is greedy, top_k 0 keeps
every token, top_p above 1 keeps every token (`sampling_inputs`).

This module imports jax, numpy, tokenizers and safetensors only (plus
shipyard.errors): the model code is not needed to run an artifact, which is
the point of one. The batch size and cache length are fixed at export; more
prompts than the batch run in several calls, fewer are padded with rows whose
output is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from shipyard.errors import ConfigError, DataError

FORMAT = "shipyard-stablehlo"
"""manifest.json's "format": what tells an artifact from any other directory with a manifest."""
FORMAT_VERSION = 2
"""The layout of the directory and the programs' signatures; a runner reads only its own version.
(2: a PRNG key per row, where 1 had one key for the whole batch.)"""
MANIFEST, PREFILL, DECODE, WEIGHTS, TOKENIZER = (
    "manifest.json",
    "prefill.stablehlo",
    "decode.stablehlo",
    "weights.safetensors",
    "tokenizer",
)
TOP_P_OFF = 2.0
"""The top_p input that keeps every token (the nucleus rule drops a token when the mass before it
reaches top_p, which never happens above 1)."""


def is_artifact(path: str | Path) -> bool:
    """Whether `path` is meant as an artifact: a manifest.json naming this format, or a prefill program
    next to a manifest (a damaged manifest is then reported as such, not as a model directory)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return False
    if (path / PREFILL).is_file():
        return True
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (ValueError, AttributeError, OSError):
        return False


def sampling_inputs(temperature: float, top_k: int | None, top_p: float | None) -> tuple:
    """The programs' sampling inputs (temperature, top_k, top_p) for a command's settings."""
    return (
        np.float32(max(temperature, 0.0)),
        np.int32(top_k or 0),
        np.float32(TOP_P_OFF if top_p is None else top_p),
    )


def read_manifest(path: Path, what: str) -> dict:
    """manifest.json of an artifact, its format and versions checked against this JAX."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise DataError(f"{what}: {path} has no {MANIFEST} (not a `shipyard export stablehlo` output)") from e
    except ValueError as e:
        raise DataError(f"{what}: {file} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{what}: {file} has format {got!r}; expected {FORMAT!r}")
    check_versions(manifest, file, what)
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise DataError(f"{what}: {file} lacks {', '.join(missing)} (expected every key export writes)")
    return manifest


_REQUIRED = ("platforms", "batch", "max_len", "decode_chunk", "eos_id", "stop_ids", "sampling", "weights")


def check_versions(manifest: dict, file: Path, what: str) -> None:
    """Refuse an artifact this runner or this JAX cannot promise to run, naming both versions.

    jax.export promises to read older programs for a while and newer ones for
    a few weeks, by release date, which nothing here can check offline; the
    JAX version is therefore required to match exactly (a deployment pins it),
    and the StableHLO and calling-convention versions are checked too, so a
    hand-edited manifest cannot slip past on the JAX version alone.
    """
    import jax
    from jax.extend.mlir.dialects import stablehlo

    def refuse(name: str, got, have, fix: str) -> None:
        raise ConfigError(f"{what}: {file}: {name} {got} does not match this runner's {have}; {fix}")

    again = "export the model again with this installation"
    if manifest.get("format_version") != FORMAT_VERSION:
        refuse("format version", manifest.get("format_version"), FORMAT_VERSION, again)
    got = manifest.get("jax_version")
    if got != jax.__version__:
        refuse("JAX version", got, jax.__version__, f"install jax=={got}, or {again}")
    versions = manifest.get("stablehlo_version")
    low, high = stablehlo.get_minimum_version(), stablehlo.get_current_version()
    if not isinstance(versions, str) or not _version_within(versions, low, high):
        refuse("StableHLO version", versions, f"supported range {low}..{high}", again)
    calling = manifest.get("calling_convention_version")
    low_cc = jax.export.minimum_supported_calling_convention_version
    high_cc = jax.export.maximum_supported_calling_convention_version
    if not isinstance(calling, int) or not low_cc <= calling <= high_cc:
        refuse("calling convention version", calling, f"supported range {low_cc}..{high_cc}", again)


def _version_within(version: str, low: str, high: str) -> bool:
    def parse(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    try:
        return parse(low) <= parse(version) <= parse(high)
    except ValueError:
        return False


def _current_platforms() -> set[str]:
    """The jax.export platform names this process's default backend runs."""
    import jax

    backend = jax.default_backend()
    return {"gpu": {"cuda", "rocm"}}.get(backend, {backend})


class Artifact:
    """A loaded artifact: its manifest, tokenizer, weights on the default device and compiled programs."""

    def __init__(self, path: str | Path, what: str = "generate"):
        import jax
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.manifest = manifest = read_manifest(self.path, what)
        platforms = manifest.get("platforms", [])
        if not _current_platforms() & set(platforms):
            raise ConfigError(
                f"{what}: {self.path} was exported for {', '.join(platforms)}, but JAX here runs on "
                f"{jax.default_backend()}; export it again with --platforms including this one"
            )
        self.batch, self.max_len, self.chunk = (
            manifest["batch"],
            manifest["max_len"],
            manifest["decode_chunk"],
        )
        self.stop_ids: tuple[int, ...] = tuple(manifest["stop_ids"])
        self.eos_id: int = manifest["eos_id"]
        prefill, decode = (self._program(name, what) for name in (PREFILL, DECODE))
        try:
            weights = load_file(str(self.path / WEIGHTS))
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise DataError(f"{what}: {self.path / WEIGHTS} is not a readable safetensors file ({e})") from e
        self._check_weights(weights, prefill, what)
        self.weights = jax.device_put(weights)
        tok_file = self.path / TOKENIZER / "tokenizer.json"
        if not tok_file.is_file():
            raise DataError(f"{what}: {self.path} has no {TOKENIZER}/tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        self._prefill = jax.jit(prefill.call)
        self._decode = jax.jit(decode.call, donate_argnums=(2, 3))  # the cache: updated in place

    def _program(self, name: str, what: str):
        import jax

        try:
            return jax.export.deserialize(bytearray((self.path / name).read_bytes()))
        except FileNotFoundError as e:
            raise DataError(f"{what}: {self.path} has no {name}") from e
        except Exception as e:  # a truncated or foreign file fails inside the flatbuffer reader
            raise DataError(
                f"{what}: {self.path / name} cannot be read by JAX {jax.__version__} "
                f"(exported with JAX {self.manifest.get('jax_version')}): {str(e).splitlines()[0][:160]}"
            ) from e

    def _check_weights(self, weights: dict[str, np.ndarray], prefill, what: str) -> None:
        """The safetensors file holds exactly the tensors the programs take, shapes and dtypes included."""
        names = self.manifest["weights"]["names"]
        if sorted(weights) != sorted(names):
            missing = sorted(set(names) - set(weights)) or sorted(set(weights) - set(names))
            raise DataError(
                f"{what}: {self.path / WEIGHTS} does not hold the tensors the programs take "
                f"(differs at {', '.join(missing[:3])})"
            )
        for name, aval in zip(sorted(names), prefill.in_avals):  # a dict's leaves come in key order
            x = weights[name]
            if tuple(x.shape) != tuple(aval.shape) or x.dtype != aval.dtype:
                raise DataError(
                    f"{what}: {self.path / WEIGHTS}: {name} is {x.dtype}{list(x.shape)}; "
                    f"the programs take {aval.dtype}{list(aval.shape)}"
                )

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids (no special tokens added; an empty prompt is the eos token alone)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids or [self.eos_id]

    def decode_text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        pad_multiple: int = 16,
        what: str = "generate",
    ) -> list[list[int]]:
        """New tokens per prompt, as `inference.engine.Engine.generate` gives them: a row ends at a stop id
        (kept) or when `stop(tokens)` says so. The prompts run `batch` at a time, every one seeded with
        `seed` (as each engine request is, so a prompt's reply does not depend on its batch). The padded prompt length is rounded up to `pad_multiple` (while the cache allows):
        each new prompt length compiles the prefill once more, so nearby lengths share one."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be at least 1, got {pad_multiple}")
        if not -(2**31) <= seed < 2**31:  # the programs take an int32 seed
            raise ConfigError(f"{what}: --seed {seed}: expected a 32-bit integer")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_len:
            raise ConfigError(
                f"{what}: a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} exceeds the "
                f"artifact's cache of {self.max_len} slots ({self.path} was exported with --max-len "
                f"{self.max_len}); shorten the prompt, ask for fewer tokens or export with a larger --max-len"
            )
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        sampling = sampling_inputs(temperature, top_k, top_p)
        out: list[list[int]] = []
        for i in range(0, len(prompts), self.batch):
            rows = prompts[i : i + self.batch]
            P = -(-max(len(p) for p in rows) // pad_multiple) * pad_multiple
            P = min(P, self.max_len - max_new_tokens)
            out += self._run_batch(rows, P, max_new_tokens, sampling, seed, stop_ids, stop)
        return out

    def _run_batch(self, prompts, P, max_new_tokens, sampling, seed, stop_ids, stop) -> list[list[int]]:
        """At most `batch` prompts, left-padded to length P; rows past them are dummies (one pad token)
        that start out done. The next decode call is queued before the host reads the previous one's
        tokens, as the engine does."""
        n, B = len(prompts), self.batch
        tokens = np.full((B, P), self.eos_id, np.int32)
        start = np.full(B, P - 1, np.int32)
        for b, p in enumerate(prompts):
            start[b] = P - len(p)
            tokens[b, start[b] :] = p
        last, k, v, key = self._prefill(self.weights, tokens, start, np.int32(seed), *sampling)
        out: list[list[int]] = [[] for _ in range(n)]
        done = np.arange(B) >= n
        stop_set = set(stop_ids)
        block, rows, pos, end = last[None], 1, P, P + max_new_tokens - 1
        while True:
            following = None
            if pos < end:
                steps = min(self.chunk, end - pos)
                following, last, k, v, key = self._decode(
                    self.weights, last, k, v, np.int32(pos), start, key, np.int32(steps), *sampling
                )
                pos += steps
            for step_tokens in np.asarray(block)[:rows].tolist():
                for b, t in enumerate(step_tokens):
                    if done[b]:
                        continue
                    out[b].append(t)
                    if t in stop_set or (stop is not None and stop(out[b])):
                        done[b] = True
                if done.all():
                    return out
            if following is None:
                return out
            block, rows = following, steps
