"""`shipyard report RUN_DIR`: plots of a run's metrics and a short report.md."""

from __future__ import annotations

import json
from pathlib import Path

from shipyard.errors import RunDirError
from shipyard.output import write_atomic

PANELS = (
    ("loss", "train loss (nats/token)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad norm"),
    ("param_norm", "param norm"),
    ("entropy", "predictive entropy (nats)"),
    ("tokens_per_s", "tokens/s"),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RunDirError(f"report: {path} does not exist (expected the run directory of `shipyard train`)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RunDirError(f"report: {path} line {n} is not JSON ({e.msg})") from e
    if not rows:
        raise RunDirError(f"report: {path} has no rows")
    return rows


def write_report(run_dir: Path) -> Path:
    """Write plots/metrics.png and report.md into `run_dir`; return the report path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    (run_dir / "plots").mkdir(exist_ok=True)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None, label="train")
        val = [(r["step"], r["val_loss"]) for r in rows if key == "loss" and r.get("val_loss") is not None]
        if val:  # held-out loss on the same axes as the train loss
            ax.plot(*zip(*val), marker="o", label="validation")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    plot = run_dir / "plots" / "metrics.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)

    first, last = rows[0], rows[-1]
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    lines = [
        f"# Run report: {run_dir}",
        "",
        f"- steps logged: {len(rows)} (last step {last['step']})",
        f"- loss: {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step {last['step']}",
        *(
            [f"- validation loss: {vals[-1][1]:.4f} at step {vals[-1][0]}"]
            if (vals := [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None])
            else []
        ),
        f"- final entropy: {last.get('entropy', float('nan')):.4f}, grad norm {last.get('grad_norm', float('nan')):.3f}",
        f"- throughput: {speeds[-1]:,.0f} tokens/s, MFU {last.get('mfu') or 0:.1%}"
        if speeds
        else "- throughput: n/a",
        f"- non-finite steps skipped: {last.get('nonfinite_total', 0)}",
        "",
        "![metrics](plots/metrics.png)",
        "",
    ]
    report = run_dir / "report.md"
    write_atomic(report, "\n".join(lines))
    return report
