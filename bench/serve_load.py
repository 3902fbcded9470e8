"""A soak test of `shipyard serve`: 16 streaming clients for minutes, 30% of them hanging up mid-stream,
then a SIGKILL mid-stream and a restart.

The model and server are bench/serve_throughput.py's (a random model of the `small` preset's shape
with an 8192-token BPE tokenizer, `--max-batch 16 --max-len 256`, EOS never the argmax). Each of
16 client threads sends streamed greedy completions one after the other for `--seconds`: a prompt
of 20..125 random token ids, `max_tokens` 16..128; with probability 0.3 a client closes the
connection after a random number of chunks, before its reply can end (a browser tab closed, a
timeout). Measured and checked:

- requests sent, finished, dropped on purpose, and failed (a non-200 or a broken stream that the
  client did not drop): 0 failed;
- after the load, within 20 s: /health `active` 0 and /metrics free slots == max slots (no leaked
  request or slot) and the cancelled counter equal to the drops that reached the server mid-reply;
- the server's resident memory (VmRSS) after the first 20% of the run (allocators warm) and at the
  end: growth < 5%;
- SIGKILL while a stream runs, then `shipyard serve` started again on the same port: seconds from
  the restart to the first answered request (the target is 10 s; the start-up compiles every decode
  shape and prefill length again, so for this model it is the start-up time).

Run it on an otherwise idle machine. JSON to --out (default bench/results/serve_load.json); exit 1
naming the checks that failed. tests/test_serve_load.py runs it in CI with `--shape tiny`.

    .venv/bin/python bench/serve_load.py [--seconds 120] [--shape small|tiny] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve_throughput as bench  # noqa: E402 (the same model and server)

CLIENTS = 16
DROP = 0.3
# --shape tiny: the same vocabulary and server, a 2-layer model (the CI test's shape: its restart
# loads fewer programs and each decode call is short, so the 16 clients press the scheduler harder)
SHAPES = {
    "small": bench.SHAPE,
    "tiny": {**bench.SHAPE, "hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 4},
}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one_request(url: str, rng: random.Random, first_id: int, counts: dict, lock) -> None:
    prompt = [rng.randrange(first_id, bench.SHAPE["vocab_size"]) for _ in range(rng.randint(20, 125))]
    max_tokens = rng.randint(16, 128)
    body = {"model": bench.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "stream": True}
    # a dropped stream hangs up within the first half of its chunks (a chunk is one decode call's
    # burst, up to --tokens-per-call 8 tokens), so before its reply could end
    drop_after = rng.randint(1, max(1, max_tokens // 16)) if rng.random() < DROP else None
    chunks, outcome = 0, "finished"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                outcome = "failed"
            else:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if drop_after is not None and chunks >= drop_after:
                            outcome = "dropped"
                            break  # leaving the block closes the connection mid-stream
                    elif line == "data: [DONE]":
                        break
    except httpx.HTTPError:
        outcome = "failed"
    with lock:
        counts[outcome] += 1
        counts["sent"] += 1


def load(url: str, seconds: float, first_id: int, pid: int) -> dict:
    counts = {"sent": 0, "finished": 0, "dropped": 0, "failed": 0}
    lock, stop_at = threading.Lock(), time.monotonic() + seconds
    rss: dict[str, int] = {}

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            one_request(url, rng, first_id, counts, lock)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(seconds * 0.2)
    rss["warm"] = rss_bytes(pid)
    for t in threads:
        t.join()
    rss["end"] = rss_bytes(pid)
    return {"counts": counts, "rss": rss}


def settle(url: str, before: dict) -> dict:
    deadline, active = time.monotonic() + 20, None
    while time.monotonic() < deadline:
        active = httpx.get(url + "/health", timeout=10).json()["active"]
        if active == 0:
            break
        time.sleep(0.2)
    m = scrape(url)

    def grew(name, *labels):
        key = (name, tuple(sorted(labels)))
        return m.get(key, 0) - before.get(key, 0)

    return {
        "active_after": active,
        "free_slots": m[("shipyard_free_slots", ())],
        "max_slots": m[("shipyard_max_slots", ())],
        "cancelled": grew("shipyard_requests_total", ("finish", "cancelled")),
        "finished_length": grew("shipyard_requests_total", ("finish", "length")),
    }


def kill_and_restart(run_dir: Path, log: Path, proc, url: str, first_id: int) -> dict:
    """SIGKILL while a stream runs; start again; seconds until a request is answered."""
    body = {"model": bench.MODEL_NAME, "prompt": list(range(first_id, first_id + 30)), "max_tokens": 128}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    t0 = time.monotonic()
    proc, url = bench.start_server(run_dir, log, 8, None, False)
    r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
    return {"restart_to_first_answer_s": time.monotonic() - t0, "status": r.status_code, "proc": proc}


def main() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the 16 clients run")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the model's shape")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve_load.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shipyard-serveload-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        first_id = bench.write_tokenizer(run_dir / "tokenizer", Path(tmp))
        bench.write_run(run_dir, first_id, SHAPES[args.shape])
        log = Path(tmp) / "server.log"
        t0 = time.monotonic()
        proc, url = bench.start_server(run_dir, log, 8, None, False)
        startup = time.monotonic() - t0
        before = scrape(url)
        result = load(url, args.seconds, first_id, proc.pid)
        result["after"] = settle(url, before)
        restart = kill_and_restart(run_dir, log, proc, url, first_id)
        proc = restart.pop("proc")
        result["restart"] = restart
        result["startup_s"] = startup
        code = bench.stop_server(proc)
    counts, rss, after = result["counts"], result["rss"], result["after"]
    result["rss_growth"] = rss["end"] / rss["warm"] - 1
    result["checks"] = {
        "no_failed_requests": counts["failed"] == 0,
        "no_leaked_requests": after["active_after"] == 0 and after["free_slots"] == after["max_slots"],
        "rss_growth_below_5_percent": result["rss_growth"] < 0.05,
        "restart_serves_within_10_s": restart["status"] == 200 and restart["restart_to_first_answer_s"] < 10,
        "exit_0_after_restart": code == 0,
    }
    result["config"] = {"seconds": args.seconds, "clients": CLIENTS, "drop_probability": DROP}
    result["config"] |= {"shape": args.shape, "model": SHAPES[args.shape]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        raise SystemExit(f"serve_load: checks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
