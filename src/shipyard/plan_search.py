"""`shipyard plan --target T --search`: the layouts of a config on a target, ranked by what its
compiler says.

Candidates: every mesh over the target's devices (pipeline stages dividing the layer stack, tensor up
to one host's 8 devices, expert dividing the experts, the rest split between fsdp and data), each
with remat none/full and the microbatching that splits the batch (train.microbatches without a
pipeline; with one, the three smallest counts of pipeline microbatches from one per stage, and
GPipe or the deepest circular schedule). The analytic plan sizes each one in milliseconds and a first-order step time ranks them
(`estimate`: compute with remat and bubble, FSDP gathers and reductions, the MoE token exchange,
each over NVLink/ICI or the network); of the layouts the analytic plan says fit, the
best-estimated one of each of the `shortlist` best meshes is compiled by the target's compiler (`plan --target`, with --compile-layers when given), after the
config's own layout (the baseline), until that many fit or twice that many were tried (XLA:TPU
refuses a program larger than HBM outright: a "does not fit" with its size), skipping layouts at
least as tight as one that did not fit (`_dominated`) and layouts whose analytic size, scaled by
the median compiled/analytic ratio so far, would not fit; the ones
the compiler says fit are ranked by the compiled roofline, and the best is compiled again in full.
MaxText and the others compile the one config you wrote; this looks for it.
"""

from __future__ import annotations

import math
import re
import statistics
from itertools import product

from shipyard.config import Config, MeshConfig, PipelineConfig
from shipyard.errors import ConfigError
from shipyard.output import progress
from shipyard.parallel.targets import GPUS_PER_HOST, Target


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: Config, n: int) -> list[dict[str, int]]:
    """Mesh sizes over `n` devices worth planning (context stays 1: a sequence of data.seq_len fits)."""
    m = cfg.model
    stack = m.num_layers - m.num_dense_layers if m.moe is not None else m.num_layers
    out = []
    for pipe in (p for p in (1, 2, 3, 4, 6, 8) if n % p == 0 and stack % p == 0):
        for tensor in (t for t in (1, 2, 4, 8) if (n // pipe) % t == 0 and m.num_kv_heads % t == 0):
            experts = _divisors(m.moe.num_experts) if m.moe is not None else [1]
            for expert in (e for e in experts if (n // (pipe * tensor)) % e == 0 and e <= 64):
                rest = n // (pipe * tensor * expert)
                for data in (d for d in (1, 2, 4, 8, 16) if rest % d == 0):
                    out.append(
                        {"pipeline": pipe, "data": data, "fsdp": rest // data, "context": 1, "tensor": tensor,
                         "expert": expert}
                    )  # fmt: skip
    return out


def candidates(cfg: Config, n: int) -> list[tuple[dict[str, int], Config]]:
    """(mesh, config) pairs: each mesh with each remat and microbatching that splits the batch."""
    out = []
    batch = cfg.train.global_batch_size
    for sizes, remat in product(meshes(cfg, n), ("none", "full")):
        split = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        if batch % split:
            continue
        rows = batch // split  # sequences per device per step
        model = cfg.model.model_copy(update={"remat": remat})
        P = sizes["pipeline"]
        if P == 1:
            for micro in (k for k in (1, 2, 4, 8, 16) if rows % k == 0):
                train = cfg.train.model_copy(update={"microbatches": micro, "pipeline": None})
                out.append((sizes, _with(cfg, sizes, model, train)))
            continue
        stack = cfg.model.num_layers - (cfg.model.num_dense_layers if cfg.model.moe is not None else 0)
        # pipeline microbatches: the divisors of the rows from P up (the circular schedule needs at
        # least one per stage), the first three: more of them shrink the bubble and the activations
        for micro in [d for d in _divisors(rows) if d >= P][:3]:
            for repeats in sorted({1, stack // P}):
                pipe = PipelineConfig(microbatches=micro, repeats=repeats)
                train = cfg.train.model_copy(update={"microbatches": 1, "pipeline": pipe})
                out.append((sizes, _with(cfg, sizes, model, train)))
    return out


def _with(cfg: Config, sizes: dict, model, train) -> Config:
    return cfg.model_copy(
        update={"model": model, "train": train, "mesh": MeshConfig(**sizes, rules=cfg.mesh.rules)}
    )


def _crosses_hosts(sizes: dict[str, int], axis: str, target: Target) -> bool:
    """Whether `axis`'s groups span GPU hosts: the mesh lays axes out outermost first (pipeline ...
    expert), 8 consecutive devices per host, so an axis is within a host when it and the axes
    inside it hold at most 8 devices. A TPU slice is all ICI."""
    if target.platform == "tpu":
        return False
    order = list(sizes)
    inner = math.prod(sizes[a] for a in order[order.index(axis) :])
    return inner > GPUS_PER_HOST


def estimate(cfg: Config, p: dict, target: Target) -> float:
    """First-order step seconds of an analytic plan `p` on `target`: what ranks the candidates before
    any compile (the compiled roofline decides among the compiled ones)."""
    chip, sizes = target.chip, p["mesh"]
    n = p["devices"]
    peak = target.per_device(chip.bf16_flops)
    remat = 4 / 3 if cfg.model.remat == "full" else 1.0
    busy = 1.0 - (p["pipeline"]["bubble"] if p.get("pipeline") else 0.0)
    compute = p["flops_per_step"] / n * remat / (peak * busy)

    def link(axis: str) -> float:
        net = chip.network_bytes_per_s if _crosses_hosts(sizes, axis, target) else None
        return net or chip.link_bytes_per_s

    comm = 0.0
    f = sizes["fsdp"]
    if f > 1:
        # the stage's bf16 params gathered for the forward, the backward (and the recompute), and
        # the gradients reduce-scattered, once per microbatch of the step
        passes = 2 + (1 if cfg.model.remat == "full" else 0) + 1
        micro = cfg.train.microbatches * (cfg.train.pipeline.microbatches if cfg.train.pipeline else 1)
        params = p["params_total"] * 2 / (sizes["pipeline"] * sizes["tensor"] * sizes["expert"] ** (cfg.model.moe is not None))  # fmt: skip
        comm += params * (f - 1) / f * passes * micro / link("fsdp")
    e = sizes["expert"]
    if e > 1 and cfg.model.moe is not None:
        # the expert group's tokens in and the outputs back, forward and backward, per MoE layer
        tokens = cfg.train.global_batch_size * cfg.data.seq_len / n
        per_layer = tokens * cfg.model.hidden_size * 2 * cfg.model.moe.experts_per_token * (e - 1) / e * 2 * 2
        comm += per_layer * cfg.model.num_moe_layers / sizes["pipeline"] / link("expert")
    t = sizes["tensor"]
    if t > 1:
        tokens = cfg.train.global_batch_size * cfg.data.seq_len / (n / t)
        comm += tokens * cfg.model.hidden_size * 2 * 4 * 2 * (t - 1) / t * cfg.model.num_layers / sizes["pipeline"] / link("tensor")  # fmt: skip
    return compute + comm


def search(cfg: Config, target: Target, compile_layers: int | None, shortlist: int = 4, top: int = 5) -> dict:
    """The ranked layouts (module doc): {"ranked": [...], "best": full plan of the best, "considered": n}."""
    from shipyard.plan import plan, target_device

    device = target_device(target)
    rows = []
    for sizes, c in candidates(cfg, target.devices):
        try:
            p = plan(c, sizes, device, with_compiled=False, target=target)
        except ConfigError:
            continue  # a layout the program refuses (schedule, context): not a candidate
        rows.append({"mesh": sizes, "config": c, "analytic": p, "estimate": estimate(c, p, target)})
    if not rows:
        raise ConfigError(f"plan --search: no layout of {cfg.run.name} splits over {target.spec}'s devices")
    fitting = sorted((r for r in rows if r["analytic"]["fits"]), key=lambda r: r["estimate"])
    # the best-estimated settings of each mesh: compiles are minutes each at scale, and spending
    # them on one mesh's remat variants would learn least
    per_mesh: dict[tuple, dict] = {}
    for r in fitting:
        per_mesh.setdefault(tuple(r["mesh"].values()), r)
    # The config's own layout first (the recipe as written is the baseline to beat), then meshes in
    # estimate order: the analytic plan can say fit where the compiler's buffers do not.
    own = next((r for r in rows if _same_layout(r["config"], cfg)), None)
    queue = ([own] if own is not None else []) + [r for r in per_mesh.values() if r is not own]
    compiled, errors = _compile_queue(queue, target, device, compile_layers, shortlist)
    good = sorted(
        (r for r in compiled if r["plan"]["fits"]), key=lambda r: r["plan"]["roofline"]["step_seconds"]
    )
    best = None
    if good:
        b = good[0]
        best = plan(b["config"], b["mesh"], device, target=target) if compile_layers else b["plan"]
    return {
        "considered": len(rows),
        "analytic_fits": len(fitting),
        "compiled": len(compiled),
        "ranked": [_row(r) for r in (good + [r for r in compiled if not r["plan"]["fits"]])][:top],
        "errors": errors,
        "own_layout": None if own is None or "plan" not in own else _row(own),
        "best": best,
        "best_overrides": overrides(cfg, good[0]["config"]) if good else [],
    }


def _compile_queue(queue: list[dict], target: Target, device, compile_layers, shortlist: int):
    """(compiled rows, refusals): the queue's layouts compiled by the target's compiler in turn until
    `shortlist` fit or twice that many were tried, skipping the ones judged not to fit before a
    compile (`_dominated`; the median compiled / analytic ratio so far: where the compiler has
    needed more than the plan said, MoE token exchange, vendor buffers, the rest is judged by it)."""
    from shipyard.plan import plan

    compiled, errors, misses, ratios = [], [], [], []
    budget = 0.9 * device.memory_bytes
    bar = progress(desc=f"compiling layouts for {target.spec}", unit="layout", total=2 * shortlist)
    for r in queue:
        if (
            sum(c["plan"]["fits"] for c in compiled) >= shortlist
            or len(compiled) + len(errors) >= 2 * shortlist
        ):
            break
        if any(_dominated(r["mesh"], miss) for miss in misses):
            continue
        if ratios and r["analytic"]["bytes"]["total"] * statistics.median(ratios) > budget:
            continue
        m = r["mesh"]
        bar.set_postfix_str(
            f"{m['pipeline']}/{m['data']}/{m['fsdp']}/{m['tensor']}/{m['expert']}", refresh=True
        )
        bar.update(1)
        try:
            r["plan"] = plan(r["config"], r["mesh"], device, compile_layers=compile_layers, target=target)
        except ConfigError as e:
            # XLA:TPU refuses a program larger than HBM: the compiler's "does not fit", with its size
            need = re.search(
                r"RESOURCE_EXHAUSTED: Ran out of memory .*?\(([\d.]+)G\) exceeds available", str(e)
            )
            errors.append({"mesh": m, "error": str(e), "temp_gib": float(need.group(1)) if need else None})
            if need:
                misses.append(m)
                ratios.append(float(need.group(1)) * 1e9 / r["analytic"]["bytes"]["total"])
            continue
        compiled.append(r)
        ratios.append(r["plan"]["compiled"]["peak_bytes"] / r["analytic"]["bytes"]["total"])
        if not r["plan"]["fits"]:
            misses.append(m)
    bar.close()
    return compiled, errors


def _dominated(mesh: dict[str, int], miss: dict[str, int]) -> bool:
    """Whether `mesh` holds at least what `miss` (a layout that did not fit) holds per device: the
    same pipeline stages, no fewer data replicas, no more fsdp or tensor sharding of the state and
    activations, and at least as wide an expert group (whose token exchange buffers grow with it)."""
    return (
        mesh["pipeline"] == miss["pipeline"]
        and mesh["data"] >= miss["data"]
        and mesh["fsdp"] <= miss["fsdp"]
        and mesh["tensor"] <= miss["tensor"]
        and mesh["expert"] >= miss["expert"]
    )


def _same_layout(a: Config, b: Config) -> bool:
    """Whether two configs lay the step out alike (mesh, remat, microbatching, schedule)."""
    mesh = lambda c: c.mesh.model_dump(exclude={"rules"})  # noqa: E731
    pipe = lambda c: None if c.train.pipeline is None else c.train.pipeline.model_dump()  # noqa: E731
    return (
        mesh(a) == mesh(b)
        and a.model.remat == b.model.remat
        and a.train.microbatches == b.train.microbatches
        and pipe(a) == pipe(b)
    )


def overrides(base: Config, chosen: Config) -> list[str]:
    """The dotted overrides that turn `base` into `chosen` (what to put in the recipe)."""
    out = []
    for axis, v in chosen.mesh.model_dump(exclude={"rules"}).items():
        if getattr(base.mesh, axis) != v:
            out.append(f"mesh.{axis}={v}")
    if base.model.remat != chosen.model.remat:
        out.append(f"model.remat={chosen.model.remat}")
    if base.train.microbatches != chosen.train.microbatches:
        out.append(f"train.microbatches={chosen.train.microbatches}")
    bp, cp = base.train.pipeline, chosen.train.pipeline
    if cp is None and bp is not None:
        out.append("train.pipeline=null")
    elif cp is not None:
        for k in ("microbatches", "repeats"):
            if bp is None or getattr(bp, k) != getattr(cp, k):
                out.append(f"train.pipeline.{k}={getattr(cp, k)}")
    return out


def _row(r: dict) -> dict:
    p = r["plan"]
    c = p["compiled"]
    return {
        "mesh": r["mesh"],
        "remat": r["config"].model.remat,
        "microbatches": r["config"].train.microbatches,
        "pipeline": None if r["config"].train.pipeline is None else r["config"].train.pipeline.model_dump(),
        "peak_bytes": c["peak_bytes"],
        "fits": p["fits"],
        "step_seconds": p["roofline"]["step_seconds"],
        "mfu": p["roofline"]["mfu"],
        "estimate_seconds": r["estimate"],
        "hlo_fingerprint": c["hlo_fingerprint"],
    }


def render(result: dict, target: Target) -> str:
    def gib(b: float) -> str:
        return f"{b / 2**30:.1f} GiB"

    lines = [
        f"search on {target.spec}: {result['considered']} layouts, {result['analytic_fits']} fit by the "
        f"analytic plan, {result['compiled']} compiled by XLA:{target.platform.upper()} (the best-estimated ones)",
        f"{'#':>2} {'mesh (pipeline/data/fsdp/tensor/expert)':<40} {'remat':<5} {'micro':>5} {'peak':>10} {'step':>9} {'MFU':>5}",
    ]
    for i, r in enumerate(result["ranked"], 1):
        m = r["mesh"]
        mesh = f"{m['pipeline']}/{m['data']}/{m['fsdp']}/{m['tensor']}/{m['expert']}"
        micro = r["pipeline"]["microbatches"] if r["pipeline"] else r["microbatches"]
        sched = f" x{r['pipeline']['repeats']}" if r["pipeline"] else ""
        verdict = "" if r["fits"] else "  does NOT fit"
        lines.append(
            f"{i:>2} {mesh + sched:<40} {r['remat']:<5} {micro:>5} {gib(r['peak_bytes']):>10} "
            f"{r['step_seconds']:>8.3g}s {r['mfu']:>5.0%}{verdict}"
        )
    for e in result.get("errors", []):
        m = e["mesh"]
        mesh = f"{m['pipeline']}/{m['data']}/{m['fsdp']}/{m['tensor']}/{m['expert']}"
        if e.get("temp_gib") is not None:
            lines.append(
                f"   {mesh}: does NOT fit: the compiler needs {e['temp_gib']:.1f} GB of temporaries alone"
            )
        else:
            lines.append(f"   {mesh}: the compiler refused it: {e['error'][:160]}")
    if result.get("own_layout"):
        lines.append(
            f"the config's own layout: {result['own_layout']['step_seconds']:.3g} s per step, "
            f"{'fits' if result['own_layout']['fits'] else 'does NOT fit'}"
        )
    if result["best"] is not None:
        b = result["best"]
        lines.append(
            f"best, compiled in full: peak {gib(b['compiled']['peak_bytes'])}, "
            f"{b['roofline']['step_seconds']:.3g} s per step, MFU {b['roofline']['mfu']:.0%}"
            f" ({'fits' if b['fits'] else 'does NOT fit'})"
        )
        lines.append(
            "recipe overrides: " + (" ".join(result["best_overrides"]) or "(none: the config's own)")
        )
    else:
        lines.append("no compiled layout fits: more devices, or a smaller model")
    return "\n".join(lines)
