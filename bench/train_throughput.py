"""Training throughput on CPU: shipyard vs Hugging Face LlamaForCausalLM + torch AdamW.

Same model (hidden 384, 6 layers, 6 heads, 2 KV heads, intermediate 1024,
vocab 8192, untied), same batch (8 x 256 tokens, fp32), same optimizer
(AdamW, clip 1.0), same run. Each trainer runs in its own child process (so
torch's OpenMP threads, which spin after every op, never steal cores from XLA
or the other way round) with the same environment, allocator included; each
warms up, then times several rounds, and the median round is reported.

    .venv/bin/python bench/train_throughput.py [--steps 8] [--rounds 3] [--out bench/results/train_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(
    vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2
)
SEQ, BATCH, LR = 256, 8, 1e-3


def shipyard_trainer(tokens: np.ndarray):
    import jax

    from shipyard.config import load_config
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state, make_train_step

    overrides = [f"model.{k}={v}" for k, v in SHAPE.items()] + [
        f"data.seq_len={SEQ}",
        f"train.global_batch_size={BATCH}",
        f"train.optimizer.lr={LR}",
        "train.optimizer.clip_norm=1.0",
        "train.schedule.kind=constant",
        "train.schedule.warmup_steps=0",
        "train.precision.compute_dtype=float32",
        "model.remat=none",
        "model.tie_embeddings=false",
    ]
    cfg = load_config("small", overrides)
    specs = param_specs(cfg.model)
    opt = build_optimizer(cfg.train, specs)
    state = init_state(cfg, init_params(specs, jax.random.key(0)), opt)
    step = jax.jit(make_train_step(cfg, opt), donate_argnums=0)
    batch = {
        "tokens": jax.numpy.asarray(tokens),
        "loss_mask": jax.numpy.ones((BATCH, SEQ), jax.numpy.float32),
    }
    holder = {"state": state}

    def run(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            holder["state"], m = step(holder["state"], batch)
        jax.block_until_ready(m["loss"])
        return time.perf_counter() - t

    return cfg, run


def torch_trainer(tokens: np.ndarray):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=SHAPE["vocab_size"],
        hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"],
        num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"],
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(hf).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.from_numpy(tokens[:, :-1].astype(np.int64))
    labels = torch.from_numpy(tokens[:, 1:].astype(np.int64))

    def one():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def run(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            one()
        return time.perf_counter() - t

    return torch.get_num_threads(), run


def _worker(name: str, steps: int, rounds: int, warmup: int) -> None:
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(BATCH, SEQ + 1)).astype(np.int32)
    if name == "shipyard":
        _, run = shipyard_trainer(tokens)
        extra = {}
    else:
        threads, run = torch_trainer(tokens)
        extra = {"threads": threads}
    run(warmup)
    times = [run(steps) / steps for _ in range(rounds)]
    print(json.dumps({"step_s": times, **extra}))


def _spawn(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", name]
    cmd += ["--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(f"{name}: " + ", ".join(f"{t:.3f}" for t in result["step_s"]) + " s/step", flush=True)
    return result


def main() -> None:
    from shipyard import cpu_tuning

    # The same process settings `shipyard train` uses; the children inherit
    # them, so torch gets the same allocator as shipyard.
    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile, allocator warm-up)")
    ap.add_argument("--worker", choices=("shipyard", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("bench/results/train_throughput.json"))
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.rounds, args.warmup)
        return

    sy = _spawn("shipyard", args)
    th = _spawn("torch", args)

    from shipyard.config import load_config
    from shipyard.train.metrics import flops_per_token, measure_matmul_peak

    tok = BATCH * SEQ
    sy_tok_s = tok / statistics.median(sy["step_s"])
    th_tok_s = tok / statistics.median(th["step_s"])
    peak = measure_matmul_peak()
    model = load_config("small", [f"model.{k}={v}" for k, v in SHAPE.items()]).model
    mfu = sy_tok_s * flops_per_token(model, SEQ) / peak
    result = {
        "benchmark": "train_throughput",
        "model": {**SHAPE, "seq_len": SEQ, "batch": BATCH, "dtype": "float32"},
        "shipyard_tokens_per_s": sy_tok_s,
        "torch_tokens_per_s": th_tok_s,
        "ratio_shipyard_over_torch": sy_tok_s / th_tok_s,
        "target_ratio": 1.3,
        "shipyard_mfu": mfu,
        "measured_matmul_peak_flops": peak,
        "shipyard_step_s": sy["step_s"],
        "torch_step_s": th["step_s"],
        "torch_threads": th["threads"],
        **cpu_tuning.environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
