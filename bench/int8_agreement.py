"""int8 weights against fp32 on a trained model: greedy agreement and held-out loss, per-channel vs group-wise scales.

A model is trained on the embedded corpus (the stdlib source as byte tokens,
`shipyard data bytes`, as the tests' fixtures use it) with `shipyard train`:
the `tiny` preset widened so that its matrices have more than 128 inputs
(hidden 256, intermediate 768, 4 layers, 4 heads of 64, 2 KV heads, vocab
512), 400 steps of 16 x 128 tokens (a few minutes on 2 cores). A run
directory given with --run is loaded instead (any model directory).

Then, for fp32, `--quantize int8` (one scale per output channel) and
`--quantize int8-g128` (one per 128 consecutive inputs of a channel), each as
`model.quantize.maybe_quantize` makes it:

- greedy agreement with fp32: the same --prompts prompts (--prompt-len bytes
  cut at seeded random places of the validation split) each continued by
  --new-tokens greedy tokens through `Engine.generate` (what generate, chat
  and serve run); per prompt whether the continuation equals fp32's and, if
  not, the first position where it differs;
- held-out loss: mean next-token cross-entropy (nats) over the first
  --heldout-windows windows of 128 tokens of the validation split (files the
  training split never saw), its change from fp32, how often the argmax at
  a position equals fp32's, and the mean KL divergence of the next-token
  distributions from fp32's (more sensitive than either);
- the quantized matrices' relative RMS error, ||dequantized - w|| / ||w||.

Results go to bench/results/int8_agreement.json. Nothing is asserted: the
numbers are what docs/cli.md quotes.

    .venv/bin/python bench/int8_agreement.py [--steps 400] [--prompts 64] [--new-tokens 32] [--run DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODEL = dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2)
"""The `tiny` preset's shape widened: every matrix has 256 or more inputs, so 128-wide groups are real."""
MODES = ("fp32", "int8", "int8-g128")
SEQ = 128
"""Held-out window length (the `tiny` preset's data.seq_len, what the model trained on)."""
TRAIN_BYTES = 8_000_000
VALIDATION_BYTES = 400_000


def train(run_dir: Path, work: Path, steps: int) -> dict:
    """`shipyard train tiny` (widened to MODEL) on the stdlib byte tokens into run_dir: how it went."""
    tokens = work / "train.npy"
    if not tokens.exists():
        from shipyard.data.bytecorpus import write_byte_tokens

        write_byte_tokens(tokens, split="train", max_bytes=TRAIN_BYTES)
    argv = [
        *(sys.executable, "-m", "shipyard.cli.main", "train", "tiny"),
        f"data.train_tokens={tokens}",
        *(f"model.{k}={v}" for k, v in MODEL.items()),
        f"train.steps={steps}",
        "train.global_batch_size=16",
        "train.schedule.warmup_steps=20",
        "train.logging.log_every=50",
        "train.logging.progress=false",
        *("--run-dir", str(run_dir)),
    ]
    t = time.perf_counter()
    subprocess.run(argv, check=True)
    return {**training_summary(run_dir), "seconds": time.perf_counter() - t}


def training_summary(run_dir: Path) -> dict | None:
    """What a run's metrics.jsonl says of its training (None for a directory without one)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in logged if r.get("loss") is not None]
    return {"last_step": losses[-1][0], "first_loss": losses[0][1], "last_logged_loss": losses[-1][1]}


def validation_tokens(work: Path) -> np.ndarray:
    path = work / "validation.npy"
    if not path.exists():
        from shipyard.data.bytecorpus import write_byte_tokens

        write_byte_tokens(path, split="validation", max_bytes=VALIDATION_BYTES)
    return np.load(path, allow_pickle=False).astype(np.int32)


def make_prompts(tokens: np.ndarray, n: int, length: int) -> list[list[int]]:
    """n windows of `length` validation tokens at seeded random offsets."""
    starts = np.random.default_rng(0).choice(tokens.size - length, size=n, replace=False)
    return [tokens[s : s + length].tolist() for s in sorted(starts)]


def score(params, cfg, windows: np.ndarray, batch: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position next-token losses (nats), argmax ids and log-probabilities over `windows` [n, SEQ + 1]."""
    import jax
    import jax.numpy as jnp
    import optax

    from shipyard.model.transformer import logits

    @jax.jit
    def run(p, x):
        out = logits(p, x[:, :-1], cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(out, x[:, 1:])
        return nll, out.argmax(-1), jax.nn.log_softmax(out)

    losses, argmax, logp = [], [], []
    for i in range(0, len(windows), batch):
        nll, top, lp = run(params, jnp.asarray(windows[i : i + batch]))
        losses.append(np.asarray(nll))
        argmax.append(np.asarray(top))
        logp.append(np.asarray(lp))
    return np.concatenate(losses), np.concatenate(argmax), np.concatenate(logp)


def weight_error(params, qparams) -> float:
    """Relative RMS error of the quantized matrices: ||dequantize(q) - w|| / ||w|| over all of them."""
    from shipyard.model import quant

    num = den = 0.0
    # by name: a tied model's quantized head is a matrix its fp32 params do not hold (the embedding is)
    pairs = [(getattr(params.blocks, n), getattr(qparams.blocks, n)) for n in quant.BLOCK_WEIGHTS]
    if params.lm_head is not None:
        pairs.append((params.lm_head, qparams.lm_head))
    for w, q in pairs:
        if q is not None and quant.is_quantized(q):
            w = np.asarray(w, np.float64)
            num += float(((np.asarray(quant.dequantize(q), np.float64) - w) ** 2).sum())
            den += float((w**2).sum())
    return (num / den) ** 0.5


def greedy(params, cfg, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations through `Engine.generate`, as `shipyard generate` runs them."""
    from shipyard.inference.engine import engine_for
    from shipyard.inference.sampling import Sampling

    engine = engine_for(params, cfg, prompts, new_tokens)
    return [list(c.tokens) for c in engine.generate(prompts, Sampling(max_tokens=new_tokens))]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the two continuations differ; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def group_sizes(params) -> dict[str, list[int]]:
    """Per quantized matrix: [scales per output channel, inputs per scale] (its group size)."""
    from shipyard.model import quant

    out = {}
    for name in quant.BLOCK_WEIGHTS:
        w = getattr(params.blocks, name)
        if quant.is_quantized(w):
            # a stacked [layers, *in, *out] weight; wo alone has two input axes, [heads, head_dim]
            n_in_axes = 2 if name == "wo" else 1
            n_in = int(np.prod(w.shape[1 : 1 + n_in_axes]))
            n_groups = int(np.prod(w.scale.shape[1 : 1 + n_in_axes]))
            out[name] = [n_groups, n_in // n_groups]
    head = params.lm_head
    if head is not None and quant.is_quantized(head):
        out["lm_head"] = [quant.groups(head), head.shape[0] // quant.groups(head)]
    return out


def main() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="a trained model directory (default: train one)")
    ap.add_argument("--work", type=Path, default=Path("runs/int8-agreement"), help="corpus and trained run")
    ap.add_argument("--steps", type=int, default=400, help="training steps when training")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/results/int8_agreement.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from shipyard.model.quantize import maybe_quantize
    from shipyard.run.model_dir import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    training = None
    run_dir = args.run
    if run_dir is None:
        run_dir = args.work / f"run-{args.steps}"
        if not (run_dir / "checkpoints").exists():
            training = train(run_dir, args.work, args.steps)
    if training is None:  # loaded: what its own log says (the seconds were those of the run that trained it)
        training = training_summary(run_dir)
    cfg, _, params = load_model(run_dir)
    params = jax.tree.map(jnp.asarray, params)
    val = validation_tokens(args.work)
    n_windows = min(args.heldout_windows, val.size // (SEQ + 1))
    windows = val[: n_windows * (SEQ + 1)].reshape(n_windows, SEQ + 1)
    prompts = make_prompts(val, args.prompts, args.prompt_len)

    rows, ref = [], None
    for mode in MODES:
        t = time.perf_counter()
        p = maybe_quantize(params, cfg.model, None if mode == "fp32" else mode)
        losses, argmax, logp = score(p, cfg.model, windows)
        outs = greedy(p, cfg.model, prompts, args.new_tokens)
        row = {"mode": mode, "heldout_loss": float(losses.mean())}
        if ref is None:
            ref = {"losses": losses, "argmax": argmax, "logp": logp, "outs": outs}
        else:
            div = [first_divergence(a, b) for a, b in zip(outs, ref["outs"])]
            diverged = [d for d in div if d is not None]
            delta = losses - ref["losses"]
            row.update(
                greedy_identical=sum(d is None for d in div),
                greedy_identical_fraction=sum(d is None for d in div) / len(div),
                first_divergence_positions=diverged,
                median_first_divergence=float(np.median(diverged)) if diverged else None,
                heldout_loss_change_nats=float(delta.mean()),
                heldout_loss_change_stderr=float(delta.std() / np.sqrt(delta.size)),
                argmax_agreement=float((argmax == ref["argmax"]).mean()),
                mean_kl_from_fp32_nats=float((np.exp(ref["logp"]) * (ref["logp"] - logp)).sum(-1).mean()),
                weight_relative_rms_error=weight_error(params, p),
                group_sizes=group_sizes(p),
            )
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "first_divergence_positions"}), flush=True)

    result = {
        "benchmark": "int8_agreement",
        "model_dir": str(run_dir),
        "model": {k: getattr(cfg.model, k) for k in ("vocab_size", *MODEL, "head_dim", "tie_embeddings")},
        "training": training,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_len,
        "new_tokens": args.new_tokens,
        "heldout_windows": n_windows,
        "heldout_tokens": int(windows[:, 1:].size),
        "results": rows,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        **cpu_tuning.environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
