"""`shipyard eval`: held-out metrics per token set and tasks for one model directory.

Token sets are scored by `heldout.domain_metrics` (loss, perplexity, bits per
byte); tasks are `mc:` and `cloze:` log-likelihood tasks (`tasks.py`) and
`chat:` exact match of greedy replies (`chat_match.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp

from shipyard.errors import DataError
from shipyard.eval.chat_match import exact_match
from shipyard.eval.heldout import DomainMetrics, domain_metrics
from shipyard.eval.tasks import cloze, multiple_choice
from shipyard.model.quantize import maybe_quantize


@dataclass
class EvalReport:
    """What `run_eval` measured for one model directory (eval.json is `to_json()`)."""

    run: str
    """The model directory."""
    step: int | None
    """Its checkpoint step (None for an imported model)."""
    domains: dict[str, DomainMetrics] = field(default_factory=dict)
    """Held-out metrics per named token set."""
    tasks: dict[str, dict] = field(default_factory=dict)
    """Task name (kind:file stem) -> that task's metrics (accuracy, exact_match, examples, ...)."""

    def to_json(self) -> dict:
        domains = {k: v.to_json() for k, v in self.domains.items()}
        return {"run": self.run, "step": self.step, "domains": domains, "tasks": self.tasks}


def run_eval(
    run_dir: Path,
    domains: dict[str, str],
    tasks: list[tuple[str, str]],
    max_sequences: int = 64,
    step: int | None = None,
    tokenizer: Path | None = None,
    quantize: str | None = None,
) -> EvalReport:
    """Held-out metrics and tasks for a model directory; `quantize` ("int8") scores its int8 weights."""
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(run_dir, "eval", tokenizer)
    cfg, step, params = model_dir.load(step, what="eval")
    tok_dir = model_dir.tokenizer()
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    if tasks and tok is None:
        model_dir.require_tokenizer("eval --task")
    params = maybe_quantize(jax.tree.map(jnp.asarray, params), cfg.model, quantize)
    report = EvalReport(str(run_dir), step)
    for name, path in domains.items():
        report.domains[name] = domain_metrics(params, cfg.model, path, tok, max_sequences)
    for kind, path in tasks:
        name = f"{kind}:{Path(path).stem}"
        if kind == "chat":  # greedy replies vs references, with the run's chat template
            from shipyard.inference.chat import chat_model

            report.tasks[name] = exact_match(chat_model(cfg, params, tok_dir), path)
            continue
        fn = {"mc": multiple_choice, "cloze": cloze}.get(kind)
        if fn is None:
            raise DataError(f"eval --task {kind}:{path}: unknown kind {kind!r} (expected mc, cloze or chat)")
        report.tasks[name] = fn(params, cfg.model, tok, Path(path))
    return report
