"""Serving throughput on CPU: `shipyard serve` (continuous batching) under 1, 4 and 16 streaming clients,
vs the same requests served one at a time by transformers' `generate`.

A random model of the `small` preset's shape (hidden 384, 6 layers, 6 heads,
2 KV heads, intermediate 1024, vocab 8192, untied, fp32; init plus Gaussian
noise so next-token distributions are peaked, as in
bench/generate_throughput.py) is saved as a shipyard run with a byte-level
BPE tokenizer of 8192 tokens trained here on synthetic pseudo-word text (the
server needs a tokenizer.json to stream text), and exported with `shipyard
export hf`. The output head's columns of the special tokens are zero, so
their logit is 0 while the best of the other 8185 is positive: EOS never
wins an argmax and every request runs to `max_tokens` (checked through each
stream's `usage.completion_tokens`).

The workload is 16 requests: token-id prompts of 16 different lengths (20 to
125 tokens), greedy (`temperature=0`), 128 new tokens each, no stop. For
each concurrency c in 1, 4, 16, one round sends all 16 requests with c client
threads (official `openai` client, `stream=True`), each thread sending its
share one after the other; so every round does the same work and the rounds
compare directly. Measured per round: aggregate tokens/s (generated tokens /
wall time from the first request sent to the last stream closed, prefill
included), per-client tokens/s (a thread's tokens / its busy time) and time
to first token (first streamed chunk). The server is `shipyard serve RUN
--max-batch 16 --max-len 256` (prompt + reply fit 256 slots: every decode
step attends over all max_len slots of every row, so a larger --max-len only
costs) in a child process on a free port, warmed up with one untimed round
at 16 clients (every prefill bucket compiled). Reported: the median of the
rounds and their spread (min, max).

The peer is transformers (`AutoModelForCausalLM`, fp32, sdpa attention,
dynamic KV cache) in its own child process, serving the same 16 requests one
at a time (batch 1, greedy, 128 new tokens, no EOS) after one untimed
request: tokens/s = 16 x 128 / the round's time. Its tokens, decoded with the
same tokenizer, are compared with each streamed reply (counted, not
asserted). Reported ratios: shipyard 16 clients / 1 client (target >= 6x),
and shipyard at 1 and 16 clients / transformers. The first is only worth
what the 1-client number is: read it together with the second (a server
whose single stream were slow would batch "well").

Caveats. Run it on an otherwise idle machine: the server and the clients
share the cores (the clients' HTTP and JSON work is on the same 2 CPUs as
the decode loop), and torch's OpenMP threads slow down by 10x or more when
another process takes a core. The children inherit the `shipyard` command's
allocator and XLA flags (cpu_tuning). The server's log is kept next to the
JSON output when --keep-log is given.

    .venv/bin/python bench/serve_throughput.py [--rounds 3] [--out bench/results/serve_throughput.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SHAPE = dict(
    vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2
)
PROMPT_LENS = tuple(20 + 7 * i for i in range(16))
NEW_TOKENS = 128
MAX_LEN = 256
MAX_BATCH = 16
CONCURRENCY = (1, 4, 16)
NOISE = 0.05
MODEL_NAME = "bench-small"


def prompts(first_id: int) -> list[list[int]]:
    """The 16 token-id prompts (ids from `first_id` up: no special token in them)."""
    rng = np.random.default_rng(0)
    return [rng.integers(first_id, SHAPE["vocab_size"], size=n).tolist() for n in PROMPT_LENS]


# -- the model ------------------------------------------------------------------------------------


def synthetic_text(path: Path, docs: int = 400, words: int = 400) -> Path:
    """A jsonl of pseudo-word prose with enough distinct words (a Zipf-like draw from 60k syllable
    strings) that BPE training reaches the full 8192-token vocabulary."""
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "qu", "st", "ng"]
    lexicon = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(60_000)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(lexicon))]
    with path.open("w") as f:
        for _ in range(docs):
            text = " ".join(rng.choices(lexicon, weights, k=words)).capitalize() + "."
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_tokenizer(out: Path, scratch: Path) -> int:
    """Train the 8192-token BPE tokenizer into `out`; the number of special tokens (ids 0..k-1)."""
    from shipyard.data.configs import ReadConfig, TokenizerTrainConfig
    from shipyard.data.tokenizer import run_tokenizer_train

    cfg = TokenizerTrainConfig(vocab_size=SHAPE["vocab_size"])
    stats = run_tokenizer_train([str(synthetic_text(scratch / "text.jsonl"))], out, cfg, ReadConfig())
    if stats["vocab_size"] != SHAPE["vocab_size"]:
        raise SystemExit(
            f"bench: the tokenizer reached {stats['vocab_size']} tokens, not {SHAPE['vocab_size']}"
        )
    return len(cfg.special_tokens)


def write_run(run_dir: Path, n_special: int, shape: dict | None = None, edit=None):
    """A shipyard run directory (config.yaml + checkpoint 1) holding random weights whose special
    tokens can never be the argmax (their head columns are zero, see the module docstring); of
    `shape` (default SHAPE: the same vocabulary, the tokenizer is the one trained for it). `edit`:
    params -> the params saved instead. Returns the params saved."""
    import jax

    from shipyard.config import load_config, to_yaml
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs
    from shipyard.run.checkpoint import Checkpointer
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state

    shape = SHAPE if shape is None else shape
    assert shape["vocab_size"] == SHAPE["vocab_size"], "the tokenizer is trained for SHAPE's vocabulary"
    overrides = [f"model.{k}={v}" for k, v in shape.items()] + ["model.tie_embeddings=false"]
    cfg = load_config("small", overrides)
    specs = param_specs(cfg.model)
    params = init_params(specs, jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(
        tree, [np.asarray(x) + NOISE * rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
    )
    head = np.array(params.lm_head)
    head[:, :n_special] = 0.0
    params = dataclasses.replace(params, lm_head=head)
    params = edit(params) if edit is not None else params
    state = init_state(cfg, jax.tree.map(jax.numpy.asarray, params), build_optimizer(cfg.train, specs))
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ckpt = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps)
    ckpt.save(1, state, wait=True)
    ckpt.close()
    return params


# -- shipyard serve and its clients ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    run_dir: Path,
    log: Path,
    tokens_per_call: int,
    quantize: str | None,
    fixed_shape: bool,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """`shipyard serve` in a child process; returns once /health answers (the engine is compiled).
    `extra`: more flags (a flag given again there wins over the one set here)."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "shipyard.cli", "serve", str(run_dir), "--port", str(port)]
    cmd += ["--max-batch", str(MAX_BATCH), "--max-len", str(MAX_LEN), "--model-name", MODEL_NAME]
    cmd += ["--tokens-per-call", str(tokens_per_call)]
    cmd += ["--quantize", quantize] if quantize else []
    cmd += ["--fixed-shape"] if fixed_shape else []
    cmd += list(extra)
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: shipyard serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"bench: shipyard serve did not come up in 300 s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _stream_one(client, prompt: list[int], t0: float) -> dict:
    """One streaming completion: its text, completion tokens and timings (seconds from `t0`)."""
    sent = time.perf_counter()
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, pieces, usage = None, [], None
    for chunk in stream:
        if chunk.choices:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {
        "sent": sent - t0,
        "ttft": first - sent,
        "end": end - t0,
        "tokens": usage,
        "text": "".join(pieces),
    }


def client_round(url: str, batch: list[list[int]], concurrency: int) -> dict:
    """All requests of `batch` sent by `concurrency` threads (thread j sends requests j, j+c, ...)."""
    import openai

    clients = [
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for _ in range(concurrency)
    ]
    results: list[dict | None] = [None] * len(batch)
    errors: list[BaseException] = []
    gate = threading.Barrier(concurrency + 1)
    t0 = 0.0

    def client_thread(j: int) -> None:
        gate.wait()
        try:
            for i in range(j, len(batch), concurrency):
                results[i] = _stream_one(clients[j], batch[i], t0)
        except BaseException as e:  # reported after the join: a failed request must fail the bench
            errors.append(e)

    threads = [threading.Thread(target=client_thread, args=(j,)) for j in range(concurrency)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    if errors:
        raise SystemExit(f"bench: a request failed at concurrency {concurrency}: {errors[0]!r}")
    short = [i for i, r in enumerate(results) if r["tokens"] != NEW_TOKENS]
    if short:
        raise SystemExit(
            f"bench: requests {short} stopped before {NEW_TOKENS} tokens (the model emitted EOS?)"
        )
    per_client = []
    for j in range(concurrency):
        mine = results[j::concurrency]
        busy = max(r["end"] for r in mine) - min(r["sent"] for r in mine)
        per_client.append(sum(r["tokens"] for r in mine) / busy)
    return {
        "wall_s": wall,
        "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "per_client_tokens_per_s": per_client,
        "ttft_s": [r["ttft"] for r in results],
        "texts": [r["text"] for r in results],
    }


def measure_server(run_dir: Path, batch: list[list[int]], args, log: Path) -> dict:
    """Warm the server up, then `args.rounds` rounds at each concurrency."""
    t = time.perf_counter()
    proc, url = start_server(run_dir, log, args.tokens_per_call, args.quantize, args.fixed_shape)
    startup = time.perf_counter() - t
    try:
        t = time.perf_counter()
        warm = client_round(url, batch, MAX_BATCH)
        warmup = time.perf_counter() - t
        print(f"shipyard serve: up in {startup:.1f} s, warm-up round {warmup:.1f} s", flush=True)
        rounds = {}
        for c in CONCURRENCY:
            rounds[c] = []
            for _ in range(args.rounds):
                rounds[c].append(client_round(url, batch, c))
                print(
                    f"  {c:2d} clients: {rounds[c][-1]['aggregate_tokens_per_s']:7.1f} tokens/s", flush=True
                )
    finally:
        code = stop_server(proc)
    if code != 0:
        raise SystemExit(f"bench: shipyard serve exited with {code} after SIGTERM:\n{log.read_text()}")
    return {"startup_s": startup, "warmup_s": warmup, "warm_texts": warm["texts"], "rounds": rounds}


# -- transformers ---------------------------------------------------------------------------------


def _transformers_worker(hf_dir: Path, first_id: int, rounds: int) -> None:
    """Child process: the 16 requests one at a time with `generate`; prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    batch = prompts(first_id)

    def one(p: list[int]) -> list[int]:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[0, len(p) :].tolist()

    t = time.perf_counter()
    one(batch[0])
    first = time.perf_counter() - t
    times, tokens = [], None
    for _ in range(rounds):
        t = time.perf_counter()
        tokens = [one(p) for p in batch]
        times.append(time.perf_counter() - t)
    print(
        json.dumps(
            {"first_call_s": first, "round_s": times, "tokens": tokens, "threads": torch.get_num_threads()}
        )
    )


def measure_transformers(hf_dir: Path, first_id: int, rounds: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "transformers", "--path", str(hf_dir)]
    cmd += ["--first-id", str(first_id), "--rounds", str(rounds)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print("transformers: " + ", ".join(f"{t:.1f}" for t in result["round_s"]) + " s/round", flush=True)
    return result


# -- the report -----------------------------------------------------------------------------------


def _summary(rounds: list[dict]) -> dict:
    agg = [r["aggregate_tokens_per_s"] for r in rounds]
    per_client = [statistics.median(r["per_client_tokens_per_s"]) for r in rounds]
    ttft = [t for r in rounds for t in r["ttft_s"]]
    return {
        "aggregate_tokens_per_s": statistics.median(agg),
        "aggregate_tokens_per_s_min_max": [min(agg), max(agg)],
        "per_client_tokens_per_s": statistics.median(per_client),
        "per_client_tokens_per_s_min_max": [min(per_client), max(per_client)],
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_max": max(ttft),
        "wall_s": [r["wall_s"] for r in rounds],
    }


def report(server: dict, tf: dict, tok_dir: Path, args) -> dict:
    import torch
    import transformers

    from shipyard import cpu_tuning
    from shipyard.data.tokenizer import load_tokenizer

    by_c = {c: _summary(rs) for c, rs in server["rounds"].items()}
    generated = len(PROMPT_LENS) * NEW_TOKENS
    tf_tok_s = generated / statistics.median(tf["round_s"])
    tok = load_tokenizer(tok_dir)
    tf_texts = [tok.decode(t, skip_special_tokens=False) for t in tf["tokens"]]
    texts = [server["warm_texts"]] + [r["texts"] for rs in server["rounds"].values() for r in rs]
    one, many = by_c[1]["aggregate_tokens_per_s"], by_c[MAX_BATCH]["aggregate_tokens_per_s"]
    return {
        "benchmark": "serve_throughput",
        "model": {**SHAPE, "tie_embeddings": False, "dtype": "float32"},
        "requests": len(PROMPT_LENS),
        "prompt_lengths": list(PROMPT_LENS),
        "new_tokens": NEW_TOKENS,
        "server": {
            "max_batch": MAX_BATCH,
            "max_len": MAX_LEN,
            "tokens_per_call": args.tokens_per_call,
            "quantize": args.quantize,
            "fixed_shape": args.fixed_shape,
        },
        "rounds": args.rounds,
        "shipyard": {f"{c}_clients": s for c, s in by_c.items()},
        "ratio_16_over_1_clients": many / one,
        "target_ratio_16_over_1": 6.0,
        "transformers_sequential_tokens_per_s": tf_tok_s,
        "transformers_best_round_tokens_per_s": generated / min(tf["round_s"]),
        "transformers_round_s": tf["round_s"],
        "transformers_first_call_s": tf["first_call_s"],
        "ratio_shipyard_1_client_over_transformers": one / tf_tok_s,
        "ratio_shipyard_16_clients_over_transformers": many / tf_tok_s,
        "requests_whose_text_equals_transformers": sum(
            a == b for a, b in zip(server["warm_texts"], tf_texts)
        ),
        "requests_whose_text_changes_between_rounds": sum(
            len({t[i] for t in texts}) > 1 for i in range(len(PROMPT_LENS))
        ),
        "server_startup_s": server["startup_s"],
        "server_warmup_round_s": server["warmup_s"],
        "torch_threads": tf["threads"],
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        **cpu_tuning.environment(),
    }


def print_table(result: dict) -> None:
    print(f"\n{'clients':>8} {'aggregate tok/s':>22} {'per-client tok/s':>22} {'TTFT median/max s':>18}")
    for name, s in result["shipyard"].items():
        lo, hi = s["aggregate_tokens_per_s_min_max"]
        plo, phi = s["per_client_tokens_per_s_min_max"]
        print(
            f"{name.split('_')[0]:>8} {s['aggregate_tokens_per_s']:8.1f} [{lo:6.1f},{hi:6.1f}]"
            f" {s['per_client_tokens_per_s']:8.1f} [{plo:6.1f},{phi:6.1f}]"
            f" {s['ttft_s_median']:8.3f}/{s['ttft_s_max']:.3f}"
        )
    print(f"transformers, one request at a time: {result['transformers_sequential_tokens_per_s']:.1f} tok/s")
    print(
        f"16 clients / 1 client: {result['ratio_16_over_1_clients']:.2f}x (target 6x); shipyard / transformers: "
        f"{result['ratio_shipyard_1_client_over_transformers']:.2f}x at 1 client, "
        f"{result['ratio_shipyard_16_clients_over_transformers']:.2f}x at 16"
    )


def main() -> None:
    from shipyard import cpu_tuning

    # The same process settings the `shipyard` command uses; the children inherit them.
    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per concurrency (and for transformers)"
    )
    ap.add_argument(
        "--tokens-per-call", type=int, default=8, help="the server's decode steps per device call"
    )
    ap.add_argument("--fixed-shape", action="store_true", help="serve with `--fixed-shape`")
    ap.add_argument("--quantize", choices=("int8",), default=None, help="serve int8 weights (`--quantize`)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve_throughput.json"))
    ap.add_argument("--keep-log", action="store_true", help="keep the server log as OUT.server.log")
    ap.add_argument("--worker", choices=("transformers",), help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--first-id", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _transformers_worker(args.path, args.first_id, args.rounds)
        return

    from shipyard.cli.main import main as shipyard

    with tempfile.TemporaryDirectory(prefix="shipyard-servebench-") as tmp:
        run_dir, hf_dir = Path(tmp) / "run", Path(tmp) / "hf"
        run_dir.mkdir()
        # <run>/tokenizer is where a run keeps its tokenizer: serve and export find it there
        n_special = write_tokenizer(run_dir / "tokenizer", Path(tmp))
        write_run(run_dir, n_special)
        if shipyard(["export", "hf", str(run_dir), str(hf_dir)]) != 0:
            raise SystemExit("bench: export hf failed")
        batch = prompts(n_special)
        log = Path(tmp) / "server.log"
        server = measure_server(run_dir, batch, args, log)
        if args.keep_log:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".server.log").write_text(log.read_text())
        tf = measure_transformers(hf_dir, n_special, args.rounds)
        result = report(server, tf, run_dir / "tokenizer", args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


if __name__ == "__main__":
    main()
