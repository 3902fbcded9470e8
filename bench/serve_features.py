"""What the serving features cost: structured output at 16 clients, against the same load unconstrained.

The model and server are bench/serve_throughput.py's (a random model of the `small` preset's shape,
8192-token BPE tokenizer, `--max-batch 16 --max-len 256`). For `--seconds` per mode, 16 client
threads send completions one after the other (prompt: 20..60 random ids, `max_tokens` 128,
temperature 0.7, a seed per request):

- structured: `response_format` json_schema, cycling through bench/json_schemas.py's 60 schemas;
- plain: the same requests replayed without response_format, each asked for exactly the tokens its
  structured reply got (`ignore_eos`), so both modes generate the same tokens from the same prompts
  and the difference is what holding replies to a grammar costs (not shorter replies' prefills).

Reported per mode: requests, completion tokens, aggregate tokens/s; for structured also the replies
that ended ("stop") and how many of them parse and validate against their schema (`jsonschema`),
and those cut at max_tokens. The cost is 1 - structured tokens/s / plain tokens/s (target <= 10%), per round; the median and range
of `--repeat` rounds (plain then structured in each, one server) are reported.
Other features of issue 30 (prefix cache, speculation) are not built yet and not measured here.

    .venv/bin/python bench/serve_features.py [--seconds 60] [--repeat 3] [--out bench/results/serve_features.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import json_schemas  # noqa: E402
import serve_throughput as bench  # noqa: E402 (the same model and server)

CLIENTS = 16
MAX_TOKENS = 128


def run_mode(url: str, seconds: float, first_id: int, replay: dict | None = None) -> dict:
    """16 clients for `seconds` of structured requests (recording each client's requests), or, with
    `replay` (a structured run's record), the same requests plain: same prompts and seeds, each
    asked for exactly as many tokens as its structured reply got (`ignore_eos`)."""
    import jsonschema

    schemas = list(json_schemas.schemas().values())
    counts = {"requests": 0, "tokens": 0, "stop": 0, "length": 0, "valid": 0, "invalid": 0, "failed": 0}
    record: dict[int, list] = {i: [] for i in range(CLIENTS)}
    lock, stop_at = threading.Lock(), time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=120) as http:
            k = i
            todo = list(replay[i]) if replay is not None else None
            while todo if todo is not None else time.monotonic() < stop_at:
                if todo is not None:
                    prompt, seed, n = todo.pop(0)
                    body = {"model": bench.MODEL_NAME, "prompt": prompt, "max_tokens": n, "ignore_eos": True}
                    schema = None
                else:
                    prompt = [
                        rng.randrange(first_id, bench.SHAPE["vocab_size"]) for _ in range(rng.randint(20, 60))
                    ]
                    seed, schema = rng.randrange(1 << 30), schemas[k % len(schemas)]
                    k += CLIENTS
                    body = {"model": bench.MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS}
                    body["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "s", "schema": schema},
                    }
                body |= {"temperature": 0.7, "seed": seed}
                r = http.post(url + "/v1/completions", json=body)
                with lock:
                    counts["requests"] += 1
                    if r.status_code != 200:
                        counts["failed"] += 1
                        continue
                    out = r.json()
                    n_out = out["usage"]["completion_tokens"]
                    counts["tokens"] += n_out
                    choice = out["choices"][0]
                    counts[choice["finish_reason"]] = counts.get(choice["finish_reason"], 0) + 1
                if schema is None:
                    continue
                record[i].append((prompt, seed, n_out))
                if choice["finish_reason"] == "stop":
                    try:
                        jsonschema.validate(json.loads(choice["text"]), schema)
                        ok = True
                    except (ValueError, jsonschema.ValidationError):
                        ok = False
                    with lock:
                        counts["valid" if ok else "invalid"] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    out = {**counts, "seconds": round(wall, 2), "tokens_per_s": round(counts["tokens"] / wall, 1)}
    return out, record


def main() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each mode runs")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (plain then structured in each)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve_features.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shipyard-servefeatures-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        first_id = bench.write_tokenizer(run_dir / "tokenizer", Path(tmp))
        bench.write_run(run_dir, first_id)
        proc, url = bench.start_server(run_dir, Path(tmp) / "server.log", 8, None, False)
        try:
            run_mode(url, 5, first_id)  # warm-up: the grammar tokenizer, allocators
            rounds = []
            for _ in range(args.repeat):
                structured, record = run_mode(url, args.seconds, first_id)
                plain, _ = run_mode(url, args.seconds, first_id, replay=record)
                cost = 1 - structured["tokens_per_s"] / plain["tokens_per_s"]
                rounds.append({"plain": plain, "structured": structured, "cost": round(cost, 3)})
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            bench.stop_server(proc)
    costs = sorted(r["cost"] for r in rounds)
    stop = sum(r["structured"]["stop"] for r in rounds)
    result = {
        "structured_output": {
            "cost_median": costs[len(costs) // 2],
            "cost_range": [costs[0], costs[-1]],
            "ended": stop,
            "valid_of_ended": sum(r["structured"]["valid"] for r in rounds),
            "failed_requests": sum(r["plain"]["failed"] + r["structured"]["failed"] for r in rounds),
            "rounds": rounds,
        },
        "config": {
            "seconds": args.seconds, "repeat": args.repeat, "clients": CLIENTS, "max_tokens": MAX_TOKENS,
            "schemas": 60,
        },
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
