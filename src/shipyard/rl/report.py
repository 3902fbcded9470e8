"""An RL run's report: plots/rl.png (rewards and held-out scores, the on-policy check, dropped groups,
time shares by step) and report.md, from its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    (("reward_mean", "eval_reward"), "reward (batch mean; held-out greedy)"),
    (("eval_pass@1", "eval_pass@k"), "held-out pass@1 / pass@k"),
    (("first_ratio_max", "ratio_max"), "importance ratio max (first / last update)"),
    (("kl_ref", "first_kl_rollout"), "KL to reference; KL(rollout || trainer) at first update"),
    (("dropped_fraction", "clip_fraction"), "groups dropped; tokens clipped"),
    (("rollout_share",), "rollout share of step time"),
)


def write_rl_report(out: Path) -> Path:
    """plots/rl.png and report.md in `out` (an RL run); returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    for row in rows:  # pass@k under one name, whatever k the run used
        k = next((key for key in row if key.startswith("eval_pass@") and key != "eval_pass@1"), None)
        if k is not None:
            row["eval_pass@k"] = row[k]
    (out / "plots").mkdir(exist_ok=True)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (keys, title) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle(str(out))
    fig.tight_layout()
    fig.savefig(out / "plots" / "rl.png", dpi=100)
    plt.close(fig)
    evals = [r for r in rows if "eval_reward" in r]
    lines = [f"# RL report: {out}", "", f"- steps: {rows[-1]['step']}"]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"- held-out reward (greedy): {first['eval_reward']:.3f} at step {first['step']} -> "
            f"{last['eval_reward']:.3f} at step {last['step']}; pass@1 {first['eval_pass@1']:.3f} -> "
            f"{last['eval_pass@1']:.3f}; pass@k {first.get('eval_pass@k', float('nan')):.3f} -> "
            f"{last.get('eval_pass@k', float('nan')):.3f}"
        )
    ratios = [r["first_ratio_max"] for r in rows if "first_ratio_max" in r]
    if ratios:
        lines.append(
            f"- importance ratio at each batch's first update: max {max(ratios):.7f} (1 is on-policy)"
        )
    lines += ["", "![metrics](plots/rl.png)", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
