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

The prefix cache (`--feature prefix`): the same model behind `--max-len 1024`, 16 streaming clients
sending a shared 512-token system prompt followed by a 10..40-token question (`max_tokens` 16,
`ignore_eos`), then the same load with a fresh random 512 tokens in front of each question (unique
prompts, nothing to share). Each round starts a server with `--prefix-cache 0` and one with the
default cache, warms each with 10 s of the shared load (the prompt buckets' programs compile
on their first use), and measures both loads on each. Reported per round: requests/s and median time
to first token (shared prompts, cache on / off: targets >= 3x and <= 0.3x) and what unique prompts
lose with the cache on (target < 3%); the median and range of `--repeat` rounds.

Speculative decoding (`--feature speculation`): one streaming client continuing code (the start of
a few of Python's own standard-library modules, as text; `max_tokens` 128, greedy, `ignore_eos`),
against a server with `--speculate 4` and one with `--speculate 0` (`--max-len 1024`, prefix cache
off so every request prefills alike). Reported per round: tokens/s of each and their ratio (target
>= 1.5x), and the share of draft tokens the model agreed with. The bench model is random, not
trained on code: what it continues is its own, and the drafts are kept only where its greedy
reply repeats its context.

A draft model (`--feature draft`): the same client and prompts against a server with
`--draft-model` and one without. No trained pair of models reaches this machine, so the bench builds
one whose agreement it controls: the target is the bench model with DRAFT_TARGET_LAYERS layers, the
draft is its first DRAFT_LAYERS layers with the same embedding and head, and the target's later
layers have their output projections (attention `wo`, MLP `w_down`) scaled by `--draft-eps`, so
with 0 the target computes exactly the draft's function and every guess is right, and larger values
make the two disagree more. The share of guesses kept is reported beside the speed-up: read the
speed-up at that agreement, not as a real draft model's.

    .venv/bin/python bench/serve_features.py [--feature structured|prefix|speculation|draft|all] [--seconds 60] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import json_schemas  # noqa: E402
import serve_throughput as bench  # noqa: E402 (the same model and server)

CLIENTS = 16
MAX_TOKENS = 128


def _run_clients(client) -> float:
    """`client(i)` for each of the CLIENTS in a thread of its own; the seconds until all are done."""
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


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

    wall = _run_clients(client)
    out = {**counts, "seconds": round(wall, 2), "tokens_per_s": round(counts["tokens"] / wall, 1)}
    return out, record


PREFIX_LEN, PREFIX_MAX_LEN, PREFIX_REPLY = 512, 1024, 16
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "bisect", "heapq", "string", "colorsys")


def code_prompts() -> list[str]:
    """The first ~600 characters of a few standard-library modules (whole lines: short enough that
    prompt and reply fit 1,024 slots in the bench tokenizer's pieces, made for pseudo-words, not code)."""
    import importlib

    out = []
    for name in CODE_MODULES:
        text = Path(importlib.import_module(name).__file__).read_text()
        out.append(text[: text.rfind("\n", 0, 600) + 1])
    return out


def speculation_load(url: str, seconds: float) -> dict:
    """One streaming client continuing code for `seconds` (greedy, 128 tokens each): tokens/s."""
    prompts, tokens, requests = code_prompts(), 0, 0
    t0 = time.monotonic()
    with httpx.Client(timeout=300) as http:
        while time.monotonic() < t0 + seconds:
            body = {"model": bench.MODEL_NAME, "prompt": prompts[requests % len(prompts)], "max_tokens": 128,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            r = http.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"bench: {r.status_code} {r.text}")
            tokens += r.json()["usage"]["completion_tokens"]
            requests += 1
    wall = time.monotonic() - t0
    return {
        "requests": requests,
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


def speculation_rounds(run_dir: Path, tmp: Path, name: str, modes: dict, seconds: float, repeat: int) -> dict:
    """`repeat` rounds of `speculation_load` against a server of `run_dir` per mode ({"off": flags,
    "on": flags}; `--max-len 1024`, prefix cache off), each warmed up first (the check and a draft's
    programs compile on first use): tokens/s, the share of drafts kept, on/off per round, median."""
    rounds = []
    for k in range(repeat):
        got = {}
        for mode, extra in modes.items():
            flags = ("--max-len", str(PREFIX_MAX_LEN), "--prefix-cache", "0", *extra)
            proc, url = bench.start_server(run_dir, tmp / f"{name}-{k}-{mode}.log", 8, None, False, flags)
            try:
                speculation_load(url, 20)  # warm-up
                got[mode] = speculation_load(url, seconds)
                counts = _scrape(url)
            finally:
                bench.stop_server(proc)
            drafted = counts.get("shipyard_spec_decode_num_draft_tokens_total", 0)
            accepted = counts.get("shipyard_spec_decode_num_accepted_tokens_total", 0)
            got[mode]["accepted_of_drafted"] = round(accepted / drafted, 3) if drafted else None
        ratio = got["on"]["tokens_per_s"] / got["off"]["tokens_per_s"]
        rounds.append({**got, "speedup": round(ratio, 3)})
        print(json.dumps(rounds[-1]), flush=True)
    values = sorted(r["speedup"] for r in rounds)
    return {
        "speedup": {"median": values[len(values) // 2], "range": [values[0], values[-1]]},
        "rounds": rounds,
    }


def measure_speculation(run_dir: Path, tmp: Path, seconds: float, repeat: int) -> dict:
    modes = {"off": ("--speculate", "0"), "on": ("--speculate", "4")}
    return {
        **speculation_rounds(run_dir, tmp, "spec", modes, seconds, repeat),
        "config": {"seconds": seconds, "repeat": repeat, "clients": 1, "speculate": 4, "max_tokens": 128,
                   "prompts": [f"{m}.py (first ~600 characters)" for m in CODE_MODULES]},
    }  # fmt: skip


DRAFT_TARGET_LAYERS = 12
"""Layers of the target model of `--feature draft` (the bench shape's width)."""

DRAFT_LAYERS = 2
"""Layers of its draft model (its first ones; the embedding and head are shared)."""


def write_draft_pair(tokenizer: Path, target: Path, draft: Path, first_id: int, eps: float) -> None:
    """A target run and a draft run (`--feature draft`) with the bench `tokenizer`: the draft is the
    target's first DRAFT_LAYERS layers; the target's later layers add `eps` x what they would (their
    output projections scaled)."""
    import dataclasses

    import jax

    def damp(params):
        blocks = params.blocks
        scale = np.where(np.arange(DRAFT_TARGET_LAYERS) < DRAFT_LAYERS, 1.0, eps).astype(np.float32)
        wo = np.asarray(blocks.wo) * scale.reshape(-1, *[1] * (blocks.wo.ndim - 1))
        down = np.asarray(blocks.w_down) * scale.reshape(-1, *[1] * (blocks.w_down.ndim - 1))
        return dataclasses.replace(params, blocks=dataclasses.replace(blocks, wo=wo, w_down=down))

    for d in (target, draft):
        d.mkdir()
        shutil.copytree(tokenizer, d / "tokenizer")
    shape = {**bench.SHAPE, "num_layers": DRAFT_TARGET_LAYERS}
    kept = bench.write_run(target, first_id, shape, edit=damp)
    first = dataclasses.replace(
        kept, blocks=jax.tree.map(lambda a: np.asarray(a)[:DRAFT_LAYERS], kept.blocks)
    )
    bench.write_run(draft, first_id, {**bench.SHAPE, "num_layers": DRAFT_LAYERS}, edit=lambda _: first)


def measure_draft(tmp: Path, first_id: int, seconds: float, repeat: int, eps: float) -> dict:
    target, draft = tmp / "draft-target", tmp / "draft-model"
    write_draft_pair(tmp / "run" / "tokenizer", target, draft, first_id, eps)
    modes = {"off": (), "on": ("--draft-model", str(draft))}
    return {
        **speculation_rounds(target, tmp, "draft", modes, seconds, repeat),
        "config": {"seconds": seconds, "repeat": repeat, "clients": 1, "speculate": 4, "max_tokens": 128,
                   "target_layers": DRAFT_TARGET_LAYERS, "draft_layers": DRAFT_LAYERS, "eps": eps,
                   "shape": bench.SHAPE, "prompts": [f"{m}.py (first ~600 characters)" for m in CODE_MODULES]},
    }  # fmt: skip


def prefix_load(url: str, seconds: float, first_id: int, shared: bool) -> dict:
    """16 streaming clients for `seconds`: a 512-token system prompt (the same one for all when
    `shared`, else fresh random tokens per request) and a 10..40-token question each, 16 tokens
    back. Requests/s, tokens/s and the median time to first token (the first streamed token)."""
    system = random.Random(0).choices(range(first_id, bench.SHAPE["vocab_size"]), k=PREFIX_LEN)
    ttfts: list[float] = []
    counts = {"requests": 0, "tokens": 0, "failed": 0}
    lock, stop_at = threading.Lock(), time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(1000 + i)
        ids = range(first_id, bench.SHAPE["vocab_size"])
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < stop_at:
                head = system if shared else rng.choices(ids, k=PREFIX_LEN)
                prompt = head + rng.choices(ids, k=rng.randint(10, 40))
                body = {"model": bench.MODEL_NAME, "prompt": prompt, "max_tokens": PREFIX_REPLY,
                        "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
                t0, first, tokens = time.monotonic(), None, 0
                with http.stream("POST", url + "/v1/completions", json=body) as r:
                    ok = r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            first = first or time.monotonic()
                            tokens += 1
                with lock:
                    counts["requests"] += 1
                    counts["failed"] += not ok or first is None
                    counts["tokens"] += PREFIX_REPLY if ok else 0
                    if first is not None:
                        ttfts.append(first - t0)

    wall = _run_clients(client)
    ttfts.sort()
    return {
        **counts, "seconds": round(wall, 2), "requests_per_s": round(counts["requests"] / wall, 3),
        "tokens_per_s": round(counts["tokens"] / wall, 1), "ttft_median_s": round(ttfts[len(ttfts) // 2], 4),
    }  # fmt: skip


def _scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def measure_prefix(run_dir: Path, tmp: Path, first_id: int, seconds: float, repeat: int) -> dict:
    rounds = []
    for k in range(repeat):
        modes = {}
        for mode, flag in (("off", "0"), ("on", None)):
            extra = ("--max-len", str(PREFIX_MAX_LEN), *(("--prefix-cache", flag) if flag else ()))
            proc, url = bench.start_server(run_dir, tmp / f"prefix-{k}-{mode}.log", 8, None, False, extra)
            try:
                prefix_load(url, 10, first_id, shared=True)  # warm-up: the buckets' prefills compile
                before = _scrape(url)
                shared = prefix_load(url, seconds, first_id, shared=True)
                after = _scrape(url)
                unique = prefix_load(url, seconds, first_id, shared=False)
            finally:
                bench.stop_server(proc)
            hits = "shipyard_prefix_cache_hits_total"
            shared["prefix_hits"] = after.get(hits, 0) - before.get(hits, 0)
            modes[mode] = {"shared": shared, "unique": unique}
        on, off = modes["on"], modes["off"]
        rounds.append({
            **modes,
            "shared_requests_per_s_ratio": round(on["shared"]["requests_per_s"] / off["shared"]["requests_per_s"], 3),
            "shared_ttft_ratio": round(on["shared"]["ttft_median_s"] / off["shared"]["ttft_median_s"], 3),
            "unique_loss": round(1 - on["unique"]["tokens_per_s"] / off["unique"]["tokens_per_s"], 3),
        })  # fmt: skip
        print(json.dumps(rounds[-1]), flush=True)

    def spread(key: str) -> dict:
        values = sorted(r[key] for r in rounds)
        return {"median": values[len(values) // 2], "range": [values[0], values[-1]]}

    return {
        "shared_requests_per_s_ratio": spread("shared_requests_per_s_ratio"),
        "shared_ttft_ratio": spread("shared_ttft_ratio"),
        "unique_loss": spread("unique_loss"),
        "failed_requests": sum(r[m][load]["failed"] for r in rounds for m in ("on", "off") for load in ("shared", "unique")),
        "rounds": rounds,
        "config": {"seconds": seconds, "repeat": repeat, "clients": CLIENTS, "system_prompt": PREFIX_LEN,
                   "question": [10, 40], "max_tokens": PREFIX_REPLY, "max_len": PREFIX_MAX_LEN,
                   "prefix_cache": "default (2) vs 0"},
    }  # fmt: skip


def main() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    cpu_tuning.apply_xla_flags()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each mode runs")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (plain then structured in each)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve_features.json"))
    ap.add_argument(
        "--feature", choices=("structured", "prefix", "speculation", "draft", "all"), default="all"
    )
    ap.add_argument(
        "--draft-eps", type=float, default=0.0, help="--feature draft: the target's later layers' scale"
    )
    args = ap.parse_args()
    # the file holds each feature's last measurement: one run of one feature keeps the others'
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="shipyard-servefeatures-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        first_id = bench.write_tokenizer(run_dir / "tokenizer", Path(tmp))
        bench.write_run(run_dir, first_id)
        if args.feature in ("prefix", "all"):
            result["prefix_cache"] = measure_prefix(run_dir, Path(tmp), first_id, args.seconds, args.repeat)
        if args.feature in ("speculation", "all"):
            result["speculation"] = measure_speculation(run_dir, Path(tmp), args.seconds, args.repeat)
        if args.feature in ("draft", "all"):
            result["draft_model"] = measure_draft(
                Path(tmp), first_id, args.seconds, args.repeat, args.draft_eps
            )
        if args.feature in ("structured", "all"):
            result.update(measure_structured(run_dir, Path(tmp), first_id, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def measure_structured(run_dir: Path, tmp: Path, first_id: int, args) -> dict:
    """Structured output's cost: `--repeat` rounds of structured then the same requests plain."""
    proc, url = bench.start_server(run_dir, tmp / "server.log", 8, None, False)
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
    return {
        "structured_output": {
            "cost_median": costs[len(costs) // 2],
            "cost_range": [costs[0], costs[-1]],
            "ended": sum(r["structured"]["stop"] for r in rounds),
            "valid_of_ended": sum(r["structured"]["valid"] for r in rounds),
            "failed_requests": sum(r["plain"]["failed"] + r["structured"]["failed"] for r in rounds),
            "rounds": rounds,
        },
        "config": {
            "seconds": args.seconds, "repeat": args.repeat, "clients": CLIENTS, "max_tokens": MAX_TOKENS,
            "schemas": 60,
        },
    }  # fmt: skip


if __name__ == "__main__":
    main()
