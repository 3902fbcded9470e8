"""What each pipeline step kind does, a function of (out_dir, inputs, config), and which of its files are its artifacts.

A step function writes its whole output into `out_dir` (which does not exist
yet; data stages create it atomically themselves). `inputs` maps the step's
input roles to paths (an upstream step's output directory, or a file/dir the
pipeline names). `config` is the step's `config:` mapping from the pipeline
file, validated by the same schema the standalone command uses.

`digest(kind, out)` hashes what a step produced for `shipyard reproduce`:
the files that are a deterministic function of the inputs (documents, shards,
tokenizer, the trained params and loss curve, evaluation numbers), leaving out
timing and provenance records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shipyard.errors import ConfigError

StepFn = Callable[[Path, dict[str, Path], dict], dict]


def _need(kind: str, inputs: dict[str, Path], *roles: str) -> list[Path]:
    missing = [r for r in roles if r not in inputs]
    if missing:
        raise ConfigError(
            f"pipeline step kind {kind}: inputs {missing} are required (given: {sorted(inputs)})"
        )
    return [inputs[r] for r in roles]


def _stage(kind: str, schema_name: str, module_name: str):
    """A document stage (filter, dedup, ...) over `inputs.documents`."""

    def run(out: Path, inputs: dict[str, Path], config: dict) -> dict:
        from shipyard.data import configs
        from shipyard.data.stage import step_workers

        (docs,) = _need(kind, inputs, "documents")
        read = configs.build_schema(configs.ReadConfig, config.get("read", {}), f"{kind}.read")
        cfg = configs.build_schema(
            getattr(configs, schema_name), {k: v for k, v in config.items() if k != "read"}, kind
        )
        module = __import__(f"shipyard.data.{module_name}", fromlist=["x"])
        fn = getattr(module, f"run_{kind}")
        return fn([str(docs)], out, cfg, read, step_workers(), False)

    return run


def _stdlib(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data.stdlib import write_stdlib_documents

    return write_stdlib_documents(out)


def _tokenizer_train(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data import configs
    from shipyard.data.tokenizer import run_tokenizer_train

    (docs,) = _need("tokenizer-train", inputs, "documents")
    read = configs.build_schema(configs.ReadConfig, config.get("read", {}), "tokenizer-train.read")
    cfg = configs.build_schema(
        configs.TokenizerTrainConfig, {k: v for k, v in config.items() if k != "read"}, "tokenizer-train"
    )
    return run_tokenizer_train([str(docs)], out, cfg, read, False)


def _tokenize(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data import configs
    from shipyard.data.stage import step_workers
    from shipyard.data.tokenize import run_tokenize

    docs, tok = _need("tokenize", inputs, "documents", "tokenizer")
    read = configs.build_schema(configs.ReadConfig, config.get("read", {}), "tokenize.read")
    cfg = configs.build_schema(
        configs.TokenizeConfig, {k: v for k, v in config.items() if k != "read"}, "tokenize"
    )
    return run_tokenize([str(docs)], out, str(tok), cfg, read, step_workers(), False)


def _stage_configs(kind: str, schema_name: str, config: dict):
    """(stage config, read config) of a step: `read:` is the reading section, the rest the stage's."""
    from shipyard.data import configs

    read = configs.build_schema(configs.ReadConfig, config.get("read", {}), f"{kind}.read")
    fields = {k: v for k, v in config.items() if k != "read"}
    return configs.build_schema(getattr(configs, schema_name), fields, kind), read


def _classifier_train(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data.classifier import run_classifier_train

    pos, neg = _need("classifier-train", inputs, "positive", "negative")
    cfg, read = _stage_configs("classifier-train", "ClassifierTrainConfig", config)
    return run_classifier_train([str(pos)], [str(neg)], out, cfg, read, False)


def _classify(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data.classifier import run_classify
    from shipyard.data.stage import step_workers

    docs, model = _need("classify", inputs, "documents", "model")
    cfg, read = _stage_configs("classify", "ClassifyConfig", config)
    return run_classify([str(docs)], out, model, cfg, read, step_workers(), False)


def _train(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.config import load_config
    from shipyard.train.trainer import train

    (tokens,) = _need("train", inputs, "train_tokens")
    overrides = [f"data.train_tokens={tokens}", *config.get("overrides", [])]
    if "validation_tokens" in inputs:
        overrides.append(f"data.validation_tokens={inputs['validation_tokens']}")
    cfg = load_config(config.get("preset", "tiny"), overrides)
    train(cfg, run_dir=out, overwrite=True)
    return {"run_dir": str(out)}


def _eval(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    """Held-out loss / bits-per-byte of the run next to the unigram baseline of its training tokens."""
    from shipyard.config import load_config
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.eval.evaluate import run_eval
    from shipyard.eval.heldout import unigram_metrics
    from shipyard.run.model_dir import tokenizer_of

    run, heldout = _need("eval", inputs, "run", "tokens")
    max_sequences = int(config.get("max_sequences", 64))
    report = run_eval(run, {"heldout": str(heldout)}, [], max_sequences=max_sequences).to_json()
    cfg = load_config(str(run / "config.yaml"))
    tok_dir = tokenizer_of(run, cfg)
    if tok_dir is not None and cfg.data.train_tokens is not None:
        tok = load_tokenizer(tok_dir)
        # on the very tokens the model was scored on (its first max_sequences sequences)
        base = unigram_metrics(cfg.data.train_tokens, cfg.model, heldout, tok, max_sequences).to_json()
        report["unigram_baseline"] = base
        model_bpb = report["domains"]["heldout"]["bits_per_byte"]
        report["bits_per_byte_vs_unigram"] = model_bpb / base["bits_per_byte"]
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _export_hf(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.interop.hf import write_hf_dir
    from shipyard.run.model_dir import open_model_dir

    (run,) = _need("export-hf", inputs, "run")
    model_dir = open_model_dir(run, "export-hf")
    weights = model_dir.load(to_host=False, what="export-hf")
    tok_dir = model_dir.tokenizer()
    files = write_hf_dir(
        weights.params, weights.config.model, out, tok_dir, generation_file=model_dir.generation_file()
    )
    return {"step": weights.step, "files": files, "tokenizer": str(tok_dir) if tok_dir else None}


def _generate(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.inference.engine import engine_for
    from shipyard.inference.sampling import GENERATE, resolve_sampling
    from shipyard.run.model_dir import open_model_dir

    (run,) = _need("generate", inputs, "run")
    model_dir = open_model_dir(run, "generate")
    cfg, step, params = model_dir.load(what="generate")
    tok = load_tokenizer(model_dir.require_tokenizer("generate"))
    prompt = str(config.get("prompt", "def "))
    ids = tok.encode(prompt).ids
    # `shipyard generate`'s rule and defaults (greedy), so the sample is the command's output
    sampling = resolve_sampling(
        GENERATE, model_dir.generation("generate"), max_tokens=int(config.get("max_new_tokens", 48))
    )
    (done,) = engine_for(params, cfg.model, [ids], sampling.max_tokens).generate([ids], sampling)
    text = tok.decode(list(done.tokens))
    out.mkdir(parents=True)
    (out / "sample.json").write_text(json.dumps({"prompt": prompt, "completion": text}, indent=2) + "\n")
    return {"prompt": prompt, "completion": text}


def _report(out: Path, inputs: dict[str, Path], config: dict) -> dict:
    import shutil

    from shipyard.run.report import write_report

    (run,) = _need("report", inputs, "run")
    path = write_report(run)
    out.mkdir(parents=True)
    text = path.read_text()
    # Other inputs: data steps (their stats.json) and evaluations (eval.json), appended.
    data_rows, evals = [], []
    for role, d in sorted(inputs.items()):
        if (d / "stats.json").is_file():
            st = json.loads((d / "stats.json").read_text())
            drops = ", ".join(f"{k} {v:,}" for k, v in st.get("dropped", {}).items() if v) or "-"
            data_rows.append(
                f"| {role} | {st.get('documents_in', 0):,} | {st.get('documents_out', 0):,} | {drops} | "
                f"{st.get('tokens', '-')} | {st.get('seconds', 0):.1f} |"
            )
        if (d / "eval.json").is_file():
            ev = json.loads((d / "eval.json").read_text())
            for name, m in ev["domains"].items():
                evals.append(f"- {role} {name}: loss {m['loss']:.4f}, bits/byte {m['bits_per_byte']}")
            if "unigram_baseline" in ev:
                evals.append(
                    f"- unigram baseline: bits/byte {ev['unigram_baseline']['bits_per_byte']:.4f} "
                    f"(model / baseline = {ev['bits_per_byte_vs_unigram']:.3f})"
                )
    if data_rows:
        text += "\n## Data steps\n\n| step | documents in | out | dropped | tokens | seconds |\n|---|---|---|---|---|---|\n"
        text += "\n".join(data_rows) + "\n"
    if evals:
        text += "\n## Evaluation\n\n" + "\n".join(evals) + "\n"
    (out / "report.md").write_text(text)
    if (run / "plots").is_dir():
        shutil.copytree(run / "plots", out / "plots")
    return {"report": str(out / "report.md")}


_SCHEMAS = {
    "extract": "ExtractConfig",
    "filter": "FilterConfig",
    "dedup": "DedupConfig",
    "decontaminate": "DecontaminateConfig",
    "tokenizer-train": "TokenizerTrainConfig",
    "tokenize": "TokenizeConfig",
    "classifier-train": "ClassifierTrainConfig",
    "classify": "ClassifyConfig",
}


def validate(name: str, kind: str, config: dict, roles=()) -> None:
    """Check a step's config before anything runs (the same schemas the steps use); one-line ConfigError.
    `roles` are the step's input roles."""
    from shipyard.data import configs

    where = f"pipeline step {name} ({kind})"
    if kind in _SCHEMAS:
        configs.build_schema(configs.ReadConfig, config.get("read", {}), f"{where} read")
        fields = {k: v for k, v in config.items() if k != "read"}
        configs.build_schema(getattr(configs, _SCHEMAS[kind]), fields, where)
    elif kind == "train":
        from shipyard.config import load_config

        unknown = set(config) - {"preset", "overrides"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (expected preset, overrides)")
        # The data paths come from the inputs at run time; stand-ins let the
        # cross-field checks (eval_every needs validation tokens) see them.
        stand_ins = [f"data.{r}=<input>" for r in ("train_tokens", "validation_tokens") if r in roles]
        load_config(config.get("preset", "tiny"), [*config.get("overrides", []), *stand_ins])


STEPS: dict[str, StepFn] = {
    "stdlib": _stdlib,
    "extract": _stage("extract", "ExtractConfig", "extract"),
    "filter": _stage("filter", "FilterConfig", "filters"),
    "dedup": _stage("dedup", "DedupConfig", "dedup"),
    "decontaminate": _stage("decontaminate", "DecontaminateConfig", "decontaminate"),
    "tokenizer-train": _tokenizer_train,
    "tokenize": _tokenize,
    "classifier-train": _classifier_train,
    "classify": _classify,
    "train": _train,
    "eval": _eval,
    "export-hf": _export_hf,
    "generate": _generate,
    "report": _report,
}

# Input roles whose paths a step's output records and its consumers open: a run's config.yaml
# names its token directories (eval scores a unigram baseline of data.train_tokens). A consumer of
# such a step needs those inputs on its machine too (a pipeline root in a bucket fetches them).
PATH_INPUTS: dict[str, tuple[str, ...]] = {"train": ("train_tokens", "validation_tokens")}

# Files that record when/how long/where rather than what: left out of digests.
_VOLATILE = {"provenance.json", "_SUCCESS", "stats.json", "report.md", "prepare.json"}


def _file_digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def digest(kind: str, out: Path) -> dict[str, str]:
    """{artifact: sha256} of what a finished step produced (see the module doc)."""
    if kind == "train":
        from shipyard.run.model_dir import open_model_dir

        _, step, params = open_model_dir(out, "digest").load(what="digest")
        import jax

        h = hashlib.sha256()
        for leaf in jax.tree.leaves(params):
            h.update(np.ascontiguousarray(leaf).tobytes())
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {
            f"params@{step}": h.hexdigest(),
            "loss_curve": hashlib.sha256(json.dumps(losses).encode()).hexdigest(),
        }
    if kind == "eval":
        report = json.loads((out / "eval.json").read_text())
        report.pop("run", None)
        return {"eval.json": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()}
    if kind == "report":
        return {}  # a rendering of the run's metrics, which carry timings
    if kind == "classifier-train":
        # report.json names its input paths (upstream steps' directories move with the root)
        report = json.loads((out / "report.json").read_text())
        content = {k: report[k] for k in ("config", "counts", "held_out")}
        return {
            "model.bin": _file_digest([out / "model.bin"], out),
            "report": hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest(),
        }
    files = [p for p in out.rglob("*") if p.is_file() and p.name not in _VOLATILE]
    if kind == "tokenize":
        # The manifest records input paths and timings; its shard table is the content.
        manifest = json.loads((out / "manifest.json").read_text())
        files = [p for p in files if p.name != "manifest.json"]
        table = json.dumps(manifest["shards"], sort_keys=True).encode()
        return {"files": _file_digest(files, out), "shards": hashlib.sha256(table).hexdigest()}
    return {"files": _file_digest(files, out)}
