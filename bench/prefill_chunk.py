"""What prefilling in pieces costs: the engine's prefill of one prompt (to its first token) with
`prefill_chunk` pieces of 64, 128 and 256 tokens against one piece of the whole bucket (the layout
before the prefix cache needed a fixed grid).

The model has serve_throughput's bench shape (6 layers, hidden 384, 8,192 tokens) or, with
`--model 135m`, SmolLM2-135M's (30 layers, hidden 576, 49,152 tokens); random weights. Each
(chunk, prompt length) is timed after a warm-up call (the compilation), median of `--repeat` calls;
the JSON has every time and each chunk's ratio to the whole-bucket piece.

    .venv/bin/python bench/prefill_chunk.py [--model bench|135m] [--repeat 5] [--out bench/results/prefill_chunk.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402
from serve_throughput import SHAPE  # noqa: E402

from shipyard.config import load_config  # noqa: E402
from shipyard.inference.engine import Engine, Sampling  # noqa: E402
from shipyard.model.params import init_params  # noqa: E402
from shipyard.model.transformer import param_specs  # noqa: E402

SMOL = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3
)
LENGTHS = (200, 500, 1000)
CHUNKS = (64, 128, 256, 1024)  # 1024: every prompt here in one piece


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("bench", "135m"), default="bench")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = SHAPE if args.model == "bench" else SMOL
    cfg = load_config("small", [f"model.{k}={v}" for k, v in shape.items()] + ["model.max_seq_len=1040"])
    params = init_params(param_specs(cfg.model), jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(10, shape["vocab_size"], size=n).tolist() for n in LENGTHS}
    one = Sampling(max_tokens=1)
    times: dict[str, dict[str, list[float]]] = {}
    for chunk in CHUNKS:
        engine = Engine(params, cfg.model, max_batch=1, max_len=1040, prefill_chunk=chunk)
        times[str(chunk)] = {}
        for n, prompt in prompts.items():
            engine.generate([prompt], one)  # compiles this bucket's prefill
            runs = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                engine.generate([prompt], one)
                runs.append(time.perf_counter() - t0)
            times[str(chunk)][str(n)] = runs
            print(
                f"chunk {chunk:5d}  prompt {n:5d}: {statistics.median(runs) * 1e3:8.1f} ms", file=sys.stderr
            )
    whole = times[str(CHUNKS[-1])]
    result = {
        "model": args.model,
        "shape": shape,
        "backend": jax.default_backend(),
        "repeat": args.repeat,
        "seconds": times,
        "median_ratio_to_one_piece": {
            c: {n: statistics.median(r) / statistics.median(whole[n]) for n, r in per.items()}
            for c, per in times.items()
        },
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
