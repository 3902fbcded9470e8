"""Attention memory and time: reference ([seq, seq] scores) vs blocked (flash-style) attention.

1. XLA's compiled memory analysis (temporaries, bytes) of a training step —
   the gradient of a 2-layer model's loss — at seq 2K, 4K, 8K, 16K, batch 1,
   tiny widths (hidden 64, 2 query heads sharing 1 KV head of 32): compiled
   only, never run. Reference temporaries grow ~4x per doubling of seq
   (quadratic), blocked ~2x (linear).
2. Forward + backward time of one attention core (8 query heads, 2 KV heads,
   head_dim 64, batch 1) at seq 512 .. 4K, median of 3 on this CPU: noisy
   when other work shares the machine. This picks `attention.BLOCKED_FROM_SEQ`.

    .venv/bin/python bench/attention_memory.py [--seqs 2048 4096 8192 16384] [--out bench/results/attention_memory.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.model import attention, blocked_attention
from shipyard.model.params import abstract_params
from shipyard.model.transformer import logits, param_specs

MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)


def step_temp_bytes(impl: str, seq: int, block: int = 512) -> int:
    """Temporaries (bytes) XLA's compiled memory analysis reports for grad of the loss at this seq."""
    cfg = ModelConfig(**MODEL, max_seq_len=seq, attention_impl=impl, attention_block=block)
    params = abstract_params(param_specs(cfg))
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(p, t):
        lp = jax.nn.log_softmax(logits(p, t, cfg)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(lp, t[:, 1:, None], -1))

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def memory_table(seqs: list[int]) -> list[dict]:
    rows = []
    for impl in ("reference", "blocked"):
        prev = None
        for seq in seqs:
            temp = step_temp_bytes(impl, seq)
            rows.append(
                dict(impl=impl, seq=seq, temp_bytes=temp, ratio=None if prev is None else temp / prev)
            )
            prev = temp
    return rows


def layer_times(seqs: list[int], rounds: int = 3) -> list[dict]:
    """Median forward + backward seconds of one attention core per impl and seq."""
    rows = []
    key = jax.random.key(0)
    for seq in seqs:
        q = jax.random.normal(key, (1, seq, 2, 4, 64), jnp.float32)
        k = jax.random.normal(jax.random.fold_in(key, 1), (1, seq, 2, 64), jnp.float32)
        v = jax.random.normal(jax.random.fold_in(key, 2), (1, seq, 2, 64), jnp.float32)
        slots = jnp.arange(seq)
        cores = {
            "reference": lambda q, k, v, s=slots: attention.attend(q, k, v, attention.mask(s, s)),
            "blocked": lambda q, k, v: blocked_attention.attention(q, k, v),
        }
        for impl, core in cores.items():
            step = jax.jit(
                jax.grad(lambda q, k, v, core=core: jnp.sum(core(q, k, v) ** 2), argnums=(0, 1, 2))
            )
            jax.block_until_ready(step(q, k, v))
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                jax.block_until_ready(step(q, k, v))
                times.append(time.perf_counter() - t0)
            rows.append(dict(impl=impl, seq=seq, seconds=statistics.median(times)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--time-seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--out", default="bench/results/attention_memory.json")
    args = ap.parse_args()
    mem = memory_table(args.seqs)
    print(f"{'impl':<10} {'seq':>6} {'temp MiB':>10} {'x prev':>7}")
    for r in mem:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['impl']:<10} {r['seq']:>6} {r['temp_bytes'] / 2**20:>10.1f} {ratio:>7}")
    times = layer_times(args.time_seqs)
    print(f"\n{'impl':<10} {'seq':>6} {'fwd+bwd ms':>11}   (one attention core, median of 3, noisy)")
    for r in times:
        print(f"{r['impl']:<10} {r['seq']:>6} {r['seconds'] * 1e3:>11.1f}")
    record = dict(
        model=MODEL,
        batch=1,
        block=512,
        memory=mem,
        time_core=dict(q_heads=8, kv_heads=2, head_dim=64, batch=1, rounds=3, rows=times),
        backend=jax.default_backend(),
        devices=jax.device_count(),
        note="temporaries from compiled.memory_analysis() of jit(grad(loss)), compiled only; times noisy (shared CPU)",
    )
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
