"""`shipyard rl`'s rollout speed and where a step's time goes, with the G replies of a prompt sharing
one prefill (the default), with each reply prefilled alone (`shared_prefill=false`), and in
fixed-shape mode (`fixed_shape=true`: every token drawn from the trainer's own program over the
whole [rows, length] batch, no KV cache; log-probs bitwise the trainer's).

The model is bench/serve_throughput.py's (the `small` preset's shape, random weights, its 8,192-token
BPE tokenizer). Each round runs `steps` RL steps per mode on the same prompt file: 4 prompts of
about 200 tokens of pseudo-word prose a step, 8 replies each of up to `max_tokens` 32 (temperature 1;
a random model's reply rarely ends early), a reward that reads the reply's length (a user reward
function), one update per batch. Step 1 compiles and is left out. Reported per mode: rollout
tokens/s (reply tokens / rollout seconds), the rollout's share of step time, seconds per step; per
round the ratios shared / alone and fixed / shared; the median and range over `--repeat` rounds.

    .venv/bin/python bench/rl_throughput.py [--steps 5] [--repeat 3] [--out bench/results/rl_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit, median_range  # noqa: E402
from serve_throughput import synthetic_text, write_run, write_tokenizer  # noqa: E402

from shipyard.config import build_rl_config  # noqa: E402
from shipyard.rl.loop import run_rl  # noqa: E402

REWARD = "def score(prompt, completion, metadata):\n    return len(completion) / 100.0\n"


MODES = {
    "shared": ["shared_prefill=true"],
    "alone": ["shared_prefill=false"],
    "fixed": ["fixed_shape=true"],
}


def measure(run_dir: Path, tmp: Path, prompts: Path, steps: int, mode: str, tag: str) -> dict:
    settings = [
        "task=null", f"prompts={prompts}", f"reward={tmp / 'reward.py'}:score", f"steps={steps}",
        "group_size=8", "prompts_per_step=4", "max_tokens=32", "eval_prompts=0", "overlong=keep",
        "dynamic_sampling=false", f"save_every={steps}", *MODES[mode],
    ]  # fmt: skip
    out = tmp / f"rl-{tag}"
    run_rl(str(run_dir), out, build_rl_config(settings), say=lambda m: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]  # past step 1
    tokens = [r["reply_tokens"] * 32 for r in rows]  # 4 prompts x 8 replies
    rollout = [r["rollout_seconds"] for r in rows]
    total = [r["rollout_seconds"] + r["train_seconds"] for r in rows]
    return {
        "rollout_tokens_per_s": sum(tokens) / sum(rollout),
        "rollout_share": sum(rollout) / sum(total),
        "seconds_per_step": sum(total) / len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="shipyard-rlbench-") as name:
        tmp = Path(name)
        run_dir = tmp / "run"
        n_special = write_tokenizer(run_dir / "tokenizer", tmp)
        write_run(run_dir, n_special)
        (tmp / "reward.py").write_text(REWARD)
        text = [
            json.loads(line)["text"]
            for line in synthetic_text(tmp / "text.jsonl", docs=40).read_text().splitlines()
        ]
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:150])}) + "\n" for t in text))
        for k in range(args.repeat):
            got = {mode: measure(run_dir, tmp, prompts, args.steps, mode, f"{mode}-{k}") for mode in MODES}
            rate = {mode: m["rollout_tokens_per_s"] for mode, m in got.items()}
            rounds.append({
                **got,
                "rollout_speedup": rate["shared"] / rate["alone"],
                "fixed_vs_shared": rate["fixed"] / rate["shared"],
            })  # fmt: skip
            print(f"round {k + 1}: {rounds[-1]}", file=sys.stderr)

    def summary(get) -> dict:
        return median_range([get(r) for r in rounds])

    result = {
        "shared_rollout_tokens_per_s": summary(lambda r: r["shared"]["rollout_tokens_per_s"]),
        "alone_rollout_tokens_per_s": summary(lambda r: r["alone"]["rollout_tokens_per_s"]),
        "rollout_speedup": summary(lambda r: r["rollout_speedup"]),
        "shared_rollout_share": summary(lambda r: r["shared"]["rollout_share"]),
        "alone_rollout_share": summary(lambda r: r["alone"]["rollout_share"]),
        "fixed_rollout_tokens_per_s": summary(lambda r: r["fixed"]["rollout_tokens_per_s"]),
        "fixed_vs_shared": summary(lambda r: r["fixed_vs_shared"]),
        "fixed_rollout_share": summary(lambda r: r["fixed"]["rollout_share"]),
        "rounds": rounds,
        "config": {"steps": args.steps, "repeat": args.repeat, "prompts_per_step": 4, "group_size": 8,
                   "max_tokens": 32, "prompt_words": 150},
    }  # fmt: skip
    emit(result, args.out)


if __name__ == "__main__":
    main()
