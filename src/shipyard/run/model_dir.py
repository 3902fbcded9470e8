"""Model directories: the one place that knows what a run or an imported model holds.

Three kinds of directory hold a model shipyard can use:

- a **run** (`shipyard train`): config.yaml, checkpoints/<step> (Orbax), and
  the tokenizer under tokenizer/ or with its token shards;
- an **import** (`shipyard import hf`): config.yaml whose train.init_from
  points at its own params/ (an Orbax params tree) and the tokenizer files
  next to it;
- a **Hugging Face model directory** itself: config.json + *.safetensors (+
  tokenizer files), read in memory, nothing written.

`open_model_dir` tells them apart and returns a `ModelDir`: the resolved
config, the complete checkpoint steps, the tokenizer, the lineage (what a
fine-tuning run starts from) and a params-only restore that always gives
plain model params (a fine-tuning run's frozen part re-read from its base and
LoRA folded in). Every command that reads a model goes through it, so "what
is missing" is said the same way everywhere, prefixed by the command.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shipyard import storage
from shipyard.config import Config, MeshConfig, build_config, load_config
from shipyard.errors import ConfigError, DataError, RunDirError


class Weights(NamedTuple):
    """A model's params with the config they belong to and the checkpoint step they came from
    (None for an import)."""

    config: Config
    step: int | None
    params: Any


@dataclass(frozen=True)
class ModelDir:
    """A run directory or an `import hf` output, opened by `open_model_dir`."""

    path: Path
    """The directory."""
    kind: str
    """"run" (checkpoints/), "import" (params/) or "hf" (config.json + safetensors)."""
    config: Config
    """Its resolved config.yaml (for an HF directory: the config `import hf` would write)."""
    steps: tuple[int, ...]
    """Complete checkpoint steps, newest first (empty for an import)."""
    tokenizer_dir: Path | None = None
    """A tokenizer given by the user (`--tokenizer`), used instead of the model's own."""

    def step(self, step: int | None = None, what: str = "load") -> int | None:
        """The checkpoint `step` (default: the newest); a RunDirError naming what is missing."""
        if self.kind != "run":
            if step is not None:
                raise RunDirError(
                    f"{what}: --step {step}: {self.path} is {_LABELS[self.kind]}, which has no checkpoint steps"
                )
            return None
        if step is None:
            return self.steps[0]
        if step not in self.steps:
            raise RunDirError(
                f"{what}: {self.path} has no checkpoint {step} (available: {', '.join(map(str, self.steps))})"
            )
        return step

    @property
    def init_from(self) -> Path | None:
        """Lineage: the directory this model's training started from (a fine-tuning run's base)."""
        src = self.config.train.init_from
        return None if src is None or self.kind != "run" else Path(src)

    def tokenizer(self) -> Path | None:
        """The directory holding the tokenizer.json this model speaks, or None."""
        if self.tokenizer_dir is not None:
            return self.tokenizer_dir
        return tokenizer_of(self.path, self.config)

    def require_tokenizer(self, what: str) -> Path:
        found = self.tokenizer()
        if found is None:
            raise DataError(
                f"{what}: {self.path} has no tokenizer (a model trained on byte or id .npy files records "
                "none); give one with --tokenizer DIR (a directory holding tokenizer.json)"
            )
        return found

    def chat_format(self, template: str | None = None, what: str = "load"):
        """The chat format this model talks in: its tokenizer with `template` (default: the one the run
        trained with, `data.chat.template`, else "auto": the tokenizer's own HF chat template)."""
        return chat_format_of(self.require_tokenizer(what), template or run_template(self.config))

    def generation(self, what: str = "load"):
        """The model's generation_config.json settings (from this directory, its tokenizer/, or the
        model it was trained from), or the empty defaults when it has none."""
        from shipyard.interop.hf_config import GenerationDefaults, read_generation_config

        found = self.generation_file()
        return GenerationDefaults() if found is None else read_generation_config(found, what)

    def generation_file(self) -> Path | None:
        """Where the model's generation_config.json is, if it has one."""
        places = [self.path, self.path / "tokenizer"]
        if self.init_from is not None:
            places += [self.init_from, self.init_from.parent]  # an import's params/ sits in the import
        return next(
            (p / "generation_config.json" for p in places if (p / "generation_config.json").is_file()), None
        )

    def load(self, step: int | None = None, *, to_host: bool = True, what: str = "load") -> Weights:
        """Params only (no optimizer state is read), sharded over the local devices (fsdp over all of
        them when it divides the hidden size); with `to_host` copied to host numpy one array at a
        time, else left as those sharded device arrays."""
        import jax

        from shipyard.model.params import param_shardings
        from shipyard.model.partition import Partition
        from shipyard.model.transformer import param_specs
        from shipyard.parallel.mesh import make_mesh, rules_for

        cfg = self.config
        step = self.step(step, what)
        if self.kind == "hf" and to_host:  # already host arrays: no round trip through the devices
            return Weights(cfg, None, _read_hf_params(self.path, None, what))
        devices = jax.local_devices()
        n = len(devices) if cfg.model.hidden_size % len(devices) == 0 else 1
        mesh_cfg = MeshConfig(data=1, fsdp=n)
        mesh, rules = make_mesh(mesh_cfg, devices[:n]), rules_for(mesh_cfg)
        full = param_specs(cfg.model)
        if self.kind == "hf":
            params = _read_hf_params(self.path, param_shardings(full, mesh, rules), what)
        elif self.kind == "import":
            params = load_init_params(self.path, full, param_shardings(full, mesh, rules))
        else:
            partition = Partition(cfg.model, cfg.train.finetune)
            params = self._restore(step, partition.trainable_specs(), mesh, rules, what)
            if partition.kind != "full":
                base = base_weights(cfg, full, param_shardings(full, mesh, rules))
                params = jax.jit(partition.merged_for_export)(params, partition.frozen(base))
        if to_host:
            params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
        return Weights(cfg, step, params)

    def load_adapters(self, step: int | None = None, what: str = "export peft") -> Weights:
        """A LoRA run's adapters ({stack: {"a": {...}, "b": {...}} or None}) as host numpy."""
        import jax

        from shipyard.model.partition import Partition

        partition = Partition(self.config.model, self.config.train.finetune)
        if partition.kind != "lora":
            raise RunDirError(
                f"{what}: {self.path} did not train LoRA adapters (train.finetune.lora is not set); "
                "use `shipyard export hf` for its full weights"
            )
        step = self.step(step, what)
        adapters = self._restore(step, partition.trainable_specs(), what=what)
        return Weights(self.config, step, jax.tree.map(np.asarray, adapters))

    def verify(self, step: int, what: str = "load") -> None:
        """Refuse checkpoint `step` of a run when a file no longer matches its sha256 sidecar, in one
        line naming the file and the newest other checkpoint that verifies (no silent fallback: the
        user asked for this one). A checkpoint whose sidecar is not written yet is read as it is, as
        `--resume` does (run/checkpoint.py: verify_checksums says why)."""
        from shipyard.run.checkpoint import checkpoint_dir, verify_checksums

        directory = checkpoint_dir(self.path)
        problem = verify_checksums(directory, step)
        if problem is not None:
            raise RunDirError(
                f"{what}: checkpoint {step} of {self.path} is unusable: {problem}; "
                f"{self._alternative(directory, step, what)}"
            )

    def _alternative(self, directory: Path, bad: int, what: str) -> str:
        """Which other checkpoint to use instead, said the way `what` picks one (hashes newest first
        and stops at the first that verifies)."""
        from shipyard.run.checkpoint import verify_checksums

        others = [s for s in self.steps if s != bad]
        good = next((s for s in others if verify_checksums(directory, s) is None), None)
        if good is None:
            if not others:
                return "it is the run's only checkpoint"
            return f"no other checkpoint verifies either ({', '.join(map(str, others))}): the run has no usable checkpoint"
        if what == "train.init_from":
            return (
                f"checkpoint {good} verifies (train.init_from reads the newest: move checkpoint {bad} aside)"
            )
        if what == "lm-eval":
            return f"checkpoint {good} verifies: pass step={good} in --model_args"
        if what == "digest":
            return f"checkpoint {good} verifies; rerun the step (--force) to train it again"
        return f"checkpoint {good} verifies: pass --step {good}"

    def _restore(self, step: int, specs, mesh=None, rules=None, what: str = "load"):
        from shipyard.errors import ShipyardError
        from shipyard.model.params import abstract_params, param_shardings
        from shipyard.run.checkpoint import checkpoint_dir, restore_params

        self.verify(step, what)
        shardings = None if mesh is None else param_shardings(specs, mesh, rules)
        try:
            return restore_params(checkpoint_dir(self.path), step, abstract_params(specs, shardings))
        except ShipyardError:
            raise
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data (no sidecar yet)
            # TensorStore appends a repr of a bound method to its messages: keep what precedes it
            reason = (str(e).splitlines() or [""])[0].split(" See full TensorStore details")[0][:200]
            raise RunDirError(
                f"{what}: checkpoint {step} of {self.path} does not load ({type(e).__name__}: {reason}); "
                f"{self._alternative(checkpoint_dir(self.path), step, what)}"
            ) from e


_LABELS = {"import": "an `import hf` output", "hf": "a Hugging Face model directory"}
_KINDS = "a run directory, an `import hf` output or a Hugging Face model directory"


def _read_hf_params(path: Path, shardings, what: str):
    """An HF directory's params, read on the host and placed onto `shardings` (None: left on the host)."""
    import jax

    from shipyard.interop.hf import read_hf_dir

    _, params = read_hf_dir(path, what)
    return params if shardings is None else jax.device_put(params, shardings)


def open_model_dir(path: str | Path, what: str, tokenizer: str | Path | None = None) -> ModelDir:
    """The model directory at `path`; `what` (the command) prefixes every error. `tokenizer` (a
    directory or a tokenizer.json) replaces the model's own. A run URL (s3://...) is read from a
    verified local copy of its newest published checkpoint (run/remote.py: fetch_run)."""
    model_dir = _open(local_model_path(path, what), what)
    if tokenizer is None:
        return model_dir
    tok = Path(tokenizer)
    tok = tok.parent if tok.name == "tokenizer.json" else tok
    if not (tok / "tokenizer.json").is_file():
        raise DataError(f"{what}: --tokenizer {tokenizer} holds no tokenizer.json")
    from shipyard.data.tokenizer import load_tokenizer

    # A tokenizer with more ids than the model's vocabulary would feed it ids past its embedding
    # table, which a gather clamps silently: garbage text, no error.
    size = load_tokenizer(tok).get_vocab_size(with_added_tokens=True)
    vocab = model_dir.config.model.vocab_size
    if size > vocab:
        raise DataError(
            f"{what}: --tokenizer {tokenizer} has {size} tokens, more than the model's vocabulary of "
            f"{vocab}; give the tokenizer the model was trained with"
        )
    return replace(model_dir, tokenizer_dir=tok)


def _open(path: Path, what: str) -> ModelDir:
    from shipyard.interop.hf import is_hf_dir, read_hf_config, run_config_for
    from shipyard.run.checkpoint import available_steps, checkpoint_dir

    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{what}: {path} does not exist (expected {_KINDS})")
    if not (path / "config.yaml").is_file():
        if (path / "prefill.stablehlo").is_file():  # inference/artifact.py's layout (a layer above this one)
            raise RunDirError(
                f"{what}: {path} is a StableHLO artifact (`shipyard export stablehlo`); only "
                "`shipyard generate` runs it; give the model directory it was exported from"
            )
        if not is_hf_dir(path):
            raise RunDirError(
                f"{what}: {path} has neither config.yaml nor config.json + *.safetensors ({_KINDS})"
            )
        model = read_hf_config(path, what)
        return ModelDir(path, "hf", build_config(run_config_for(model, path)), ())
    cfg = load_config(str(path / "config.yaml"))
    if (path / "params").is_dir() and not (path / "checkpoints").is_dir():
        return ModelDir(path, "import", cfg, ())
    steps = tuple(available_steps(checkpoint_dir(path)))
    if not steps:
        raise RunDirError(f"{what}: {path} has no complete checkpoint (train it, or wait for its first save)")
    return ModelDir(path, "run", cfg, steps)


def local_model_path(path: str | Path, what: str) -> Path:
    """A model directory as a local path: a run URL fetched into the user cache, a path as it is."""

    if not storage.is_url(path):
        return Path(path)
    from shipyard.run.remote import fetch_run

    return fetch_run(str(path), what)


def load_model(
    path: str | Path, step: int | None = None, *, to_host: bool = True, what: str = "load"
) -> Weights:
    """`open_model_dir(path, what).load(step, ...)`: the params of a run or an imported model."""
    return open_model_dir(path, what).load(step, to_host=to_host, what=what)


def tokenizer_of(path: str | Path, cfg: Config | None = None) -> Path | None:
    """The one answer to "which tokenizer does the model directory at `path` speak": the directory
    holding its tokenizer.json, or None.

    Looked for in <path>/tokenizer (runs copy theirs there), <path> itself (an import, an HF
    directory), the import around a params/ directory; else what its config (`cfg`, default its
    config.yaml) recorded: data.chat.tokenizer, else its (first) local token-shard directory.
    """
    base = Path(path)
    around = [base.parent] if base.name == "params" else []  # an import's params/ sits in the import
    for candidate in (base / "tokenizer", base, *around):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    if cfg is None:
        found = next((p / "config.yaml" for p in (base, *around) if (p / "config.yaml").is_file()), None)
        if found is None:
            return None
        cfg = load_config(str(found))
    if cfg.data.chat is not None and cfg.data.chat.tokenizer is not None:
        return Path(cfg.data.chat.tokenizer)
    paths, _ = cfg.data.sources()
    return next((Path(p) for p in paths if (Path(p) / "tokenizer.json").is_file()), None)


def run_template(cfg: Config) -> str:
    """The chat template a run trained with (`data.chat.template`), else "auto" (the model's own)."""
    return cfg.data.chat.template if cfg.data.chat is not None else "auto"


def chat_format_of(tok_path: Path, template: str = "auto"):
    """The one answer to "which chat format does this run talk in": the tokenizer at `tok_path` with
    the named template ("auto": its own HF chat template when it has one, else the built-in one)."""
    from shipyard.data.chat_format import ChatFormat, pick_template
    from shipyard.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_path)
    return ChatFormat(tok, pick_template(template, tok, tok_path))


def init_from_config(init_from: str | Path) -> Config | None:
    """The resolved config of the model `init_from` names (a run, an import or its params/, an HF
    directory), or None for a bare params tree."""
    path = local_model_path(init_from, "train.init_from").absolute()
    places = [path] + ([path.parent] if path.name == "params" else [])
    for place in places:
        if (place / "config.yaml").is_file() or (place / "config.json").is_file():
            return open_model_dir(place, "train.init_from").config
    return None


def base_weights(cfg: Config, specs, shardings):
    """The params a run's training started from, at the run's own shapes: train.init_from's, else the
    seeded random init (a fine-tuning run's frozen part is re-read from here; training start-up adds
    the vocabulary resize on top: train/startup.py base_params)."""
    import jax

    from shipyard.model.params import init_params

    if cfg.train.init_from is None:
        return init_params(specs, jax.random.key(cfg.train.seed), shardings)
    return load_init_params(cfg.train.init_from, specs, shardings)


def shape_table(tree) -> dict:
    """{path: shape} of a tree of arrays, abstract arrays or ArraySpecs."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in leaves}


def check_same_shapes(params, shapes: dict, what: str):
    got = shape_table(params)
    if got != shapes:
        raise ConfigError(
            f"train.init_from: {what} holds a different model (e.g. embed {got.get('.embed')}, "
            f"expected {shapes.get('.embed')}); use the base model's config"
        )
    return params


def load_init_params(path: str | Path, specs, shardings):
    """Params to start from, restored onto `shardings`: a params-only Orbax tree (what `import hf`
    writes to OUT/params; OUT itself works too) or a run directory (its newest checkpoint; a
    fine-tuning run gives its merged params)."""
    import jax
    import orbax.checkpoint as ocp

    from shipyard.model.params import abstract_params

    path = local_model_path(path, "train.init_from").absolute()
    if not path.is_dir():
        raise ConfigError(
            f"train.init_from: {path} does not exist (expected a run directory or the output of `shipyard import hf`)"
        )
    target = abstract_params(specs, shardings)
    shapes = shape_table(target)
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        params = open_model_dir(path, "train.init_from").load(to_host=False, what="train.init_from").params
        return jax.device_put(check_same_shapes(params, shapes, f"the run {path}"), shardings)
    if not (path / "config.yaml").is_file() and (path / "config.json").is_file():
        from shipyard.interop.hf import read_hf_dir

        _, params = read_hf_dir(path, "train.init_from")
        return jax.device_put(check_same_shapes(params, shapes, f"the Hugging Face model {path}"), shardings)
    if (path / "params").is_dir():  # the `import hf` output directory itself
        path = path / "params"
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(path, target)
    except (ValueError, KeyError) as e:
        raise ConfigError(
            f"train.init_from: {path} does not hold params of this model ({str(e).splitlines()[0][:160]}); "
            f"expected e.g. embed {shapes.get('.embed')}"
        ) from e
