"""What a compiled program does per device, read from its optimized HLO text: matmul FLOPs, memory
traffic, collectives (kind, count, bytes, mesh axes), each scaled by the loops it runs in.

Why not XLA's own cost analysis: XLA:TPU's counts a `while` body once (a scanned 32-layer model
costs one layer), XLA:GPU's is not available for a compile-only device, and neither names
collectives. The text is the one thing every backend gives, so one reader serves both targets.

Counted: `dot`, `convolution` and the cuBLAS GEMM custom calls (2 x output elements x contracted
size); memory traffic as the bytes each kernel (a fusion or unfused op of a non-fused computation)
reads and writes; collectives with the bytes one device sends under ring algorithms. A `while`
multiplies its body by its trip count (XLA:GPU's `known_trip_count`, else the bound its condition
compares the counter against); a `conditional` counts its costliest branch. Vendor kernels
(Mosaic's splash attention, cuDNN's fused attention) are opaque: they are listed in `kernels`, and
their FLOPs are the caller's to add.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\)\s*->\s*.*\{\s*$")
# An instruction is indented by exactly two spaces: the lines of a Mosaic kernel's module, which a
# TPU custom call's backend_config carries over many lines, are indented deeper or start with "}}".
_INSTR = re.compile(r"^  (ROOT )?%([\w.\-]+) = (.*)$")
_END = re.compile(r"^\}(\s*$|, execution_thread=)")
"""A computation's last line: "}" or, for a SparseCore offload, "}, execution_thread=..."."""
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)
"""Collective opcodes (their `-start` forms count; `-done` only waits)."""
NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "async-start", "async-update", "async-done", "copy-done", "send-done", "recv-done",
}  # fmt: skip
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
KERNEL_TARGETS = ("tpu_custom_call", "__cudnn$fmha", "__gpu$xla.gpu.triton")
"""Custom calls whose cost the HLO does not show (Mosaic, cuDNN attention, Triton/Pallas)."""


def shape_bytes(shape: str) -> float:
    """Bytes of every array in an HLO shape (a tuple's elements summed)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def shape_dims(shape: str) -> list[list[int]]:
    """Dimensions of each array in an HLO shape."""
    return [[int(d) for d in dims.split(",") if d] for dt, dims in _ARRAY.findall(shape) if dt in DTYPE_BYTES]


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""
    """The text inside the parentheses (a constant's value)."""


@dataclass
class Computation:
    name: str
    entry: bool
    instrs: list[Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)
    root: Instr | None = None


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _instr(name: str, rest: str) -> Instr | None:
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-$.]+)\(", rest)
    if not m:
        return None
    end = _balanced(rest, m.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[m.end() : end - 1])
    return Instr(name, shape, m.group(1), operands, rest[end:], rest[m.end() : end - 1])


def parse(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text by name (the entry one has `entry`)."""
    comps: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2), bool(m.group(1)))
            continue
        if _END.match(line):
            comps[current.name] = current
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        ins = _instr(m.group(2), m.group(3))
        if ins is None:
            continue
        current.instrs.append(ins)
        current.shapes[ins.name] = ins.shape
        if m.group(1):
            current.root = ins
    return comps


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if m:
        return re.findall(r"%?([\w.\-]+)", m.group(1))
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def trip_count(while_op: Instr, comps: dict[str, Computation]) -> int | None:
    """Iterations of a while loop: XLA's known_trip_count, else the constant its condition compares
    the counter against (JAX's loops count up from 0 by 1); None when neither says."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_op.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get(next(iter(_called(while_op.attrs, "condition")), ""))
    if cond is None or cond.root is None or cond.root.opcode != "compare":
        return None
    direction = re.search(r"direction=(\w+)", cond.root.attrs)
    consts = {i.name: i for i in cond.instrs if i.opcode == "constant"}
    for k, operand in enumerate(cond.root.operands):
        if operand not in consts or not re.fullmatch(r"-?\d+", consts[operand].args.strip()):
            continue
        bound = int(consts[operand].args)
        d = direction.group(1) if direction else "LT"
        if (k == 1 and d == "LT") or (k == 0 and d == "GT"):
            return bound
        if (k == 1 and d == "LE") or (k == 0 and d == "GE"):
            return bound + 1
    return None


# ----------------------------------------------------------------------------- replica groups


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def replica_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of a collective, in any of XLA's three spellings: explicit `{{0,1},{2,3}}`,
    iota `[G,S]<=[dims]T(perm)`, and the mesh form `mesh['axis_0'=2,...], device_ids=([dims]T(perm))
    {'axis_0'}` (groups vary along the named axes). None when there are none (all devices)."""
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}",
        attrs,
    )
    if m:
        sizes = [int(s) for s in re.findall(r"=(\d+)", m.group(1))]
        names = re.findall(r"'([^']+)'=", m.group(1))
        n = math.prod(sizes)
        ids = (
            _iota(
                [int(d) for d in m.group(2).split(",")],
                [int(p) for p in m.group(3).split(",")] if m.group(3) else None,
            )
            if m.group(2)
            else np.arange(n)
        ).reshape(sizes)
        varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        fixed = [i for i in range(len(sizes)) if i not in varying]
        grouped = ids.transpose(fixed + varying).reshape(
            -1, math.prod(sizes[i] for i in varying) if varying else 1
        )
        return grouped.tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        perm = [int(p) for p in m.group(4).split(",")] if m.group(4) else None
        return _iota(dims, perm).reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", attrs)
    if m:
        groups = [
            [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m.group(1))
        ]
        return [g for g in groups if g] or None
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{?(\d+),(\d+)\}?", m.group(1) + "}")]
    return None


def group_axes(groups: list[list[int]] | None, mesh_axes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which a collective's groups span: device i of the program is the mesh's
    flat device i (a jit's device assignment is its mesh's devices in order)."""
    sizes = list(mesh_axes.values())
    names = list(mesh_axes)
    n = math.prod(sizes)
    if not groups:
        return tuple(a for a, s in mesh_axes.items() if s > 1)
    spans = set()
    for g in groups:
        coords = np.array([np.unravel_index(i % n, sizes) for i in g])
        spans.update(names[k] for k in range(len(sizes)) if len(set(coords[:, k])) > 1)
    return tuple(a for a in names if a in spans)


# ----------------------------------------------------------------------------- costs


@dataclass
class Collective:
    kind: str
    axes: tuple[str, ...]
    group: int
    """Devices per group."""
    count: float
    """Executions per step."""
    bytes: float
    """Bytes of data per execution per device (the operand)."""
    wire_bytes: float
    """Bytes one device sends per step under ring algorithms."""
    crosses_hosts: bool


@dataclass
class Costs:
    flops: float = 0.0
    fp8_flops: float = 0.0
    """The part of `flops` whose operands are fp8 (what runs at an fp8 peak)."""
    traffic_bytes: float = 0.0
    collectives: list = field(default_factory=list)
    kernels: Counter = field(default_factory=Counter)
    unknown_loops: int = 0

    def add(self, other: Costs, times: float) -> None:
        self.flops += other.flops * times
        self.fp8_flops += other.fp8_flops * times
        self.traffic_bytes += other.traffic_bytes * times
        self.collectives += [(c, n * times) for c, n in other.collectives]
        for k, v in other.kernels.items():
            self.kernels[k] += v * times
        self.unknown_loops += other.unknown_loops


def _dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
    out = math.prod(shape_dims(ins.shape)[0]) if shape_dims(ins.shape) else 0
    lhs = shape_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    if not lhs or not m:
        return 0.0
    k = math.prod(lhs[0][int(d)] for d in m.group(1).split(",") if d)
    return 2.0 * out * k


def _window_pairs(out: int, size: int, inp: int, stride: int, lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, window position) pairs of one spatial dimension that read a real input
    element, not padding or a dilation hole: what a convolution multiplies along that dimension."""
    if out * size > 4_000_000:  # no dot-like convolution is this wide; do not spend seconds counting
        return out * size
    last = (inp - 1) * lhs_dil
    pairs = 0
    for o in range(out):
        for k in range(size):
            pos = o * stride - lo + k * rhs_dil
            pairs += 0 <= pos <= last and pos % lhs_dil == 0
    return pairs


def _conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 x output batch x output features x kernel input features x the valid window pairs of every
    spatial dimension. XLA:TPU writes batched matmuls as convolutions whose padded windows walk the
    batch (`size=4 pad=3_3`), so counting the whole window would overcount by its size."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    dims = [shape_dims(ins.shape), *(shape_dims(shapes.get(o, "")) for o in ins.operands[:2])]
    if not labels or len(ins.operands) < 2 or not all(dims):
        return 0.0
    out, lhs, rhs = dims[0][0], dims[1][0], dims[2][0]
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}

    def per_dim(key: str, default: int, n: int) -> list[int]:
        if key not in fields:
            return [default] * n
        return [int(v) for v in fields[key].split("x")]

    n = sum(c.isdigit() for c in out_l)
    sizes = per_dim("size", 1, n)
    strides = per_dim("stride", 1, n)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", 1, n), per_dim("rhs_dilate", 1, n)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
    flops = 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
    for d in range(n):
        c = str(d)
        flops *= _window_pairs(
            out[out_l.index(c)], sizes[d], lhs[lhs_l.index(c)], strides[d], pads[d], lhs_dil[d], rhs_dil[d]
        )
    return flops


def _gemm_flops(ins: Instr, shapes: dict[str, str]) -> float:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    out = shape_dims(ins.shape)
    lhs = shape_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    if not m or not out or not lhs:
        return 0.0
    k = math.prod(lhs[0][int(d)] for d in re.findall(r"\d+", m.group(1)))
    return 2.0 * math.prod(out[0]) * k


class Reader:
    """Costs of one compiled module on a mesh (axis name -> size, in the mesh's order) whose flat
    devices sit on `hosts` (the host of each device; collectives across hosts use the network)."""

    def __init__(self, text: str, mesh_axes: dict[str, int], hosts: list[int] | None = None):
        self.comps = parse(text)
        self.mesh_axes = mesh_axes
        self.hosts = hosts
        self._memo: dict[tuple[str, bool], Costs] = {}

    def entry(self) -> Costs:
        name = next(c.name for c in self.comps.values() if c.entry)
        return self.costs(name, kernel_level=True)

    def costs(self, name: str, kernel_level: bool) -> Costs:
        key = (name, kernel_level)
        if key not in self._memo:
            self._memo[key] = self._costs(self.comps[name], kernel_level)
        return self._memo[key]

    def _costs(self, comp: Computation, kernel_level: bool) -> Costs:
        out = Costs()
        for ins in comp.instrs:
            op = ins.opcode
            if kernel_level and op not in NO_TRAFFIC and not op.endswith("-done"):
                out.traffic_bytes += self._traffic(ins, comp)
            if op == "dot":
                flops = _dot_flops(ins, comp.shapes)
                out.flops += flops
                if all(comp.shapes.get(o, "").startswith("f8") for o in ins.operands[:2]):
                    out.fp8_flops += flops
            elif op == "convolution":
                out.flops += _conv_flops(ins, comp.shapes)
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                target = target.group(1) if target else ""
                if target in GEMM_TARGETS:
                    flops = _gemm_flops(ins, comp.shapes)
                    out.flops += flops
                    if target.endswith("$f8"):
                        out.fp8_flops += flops
                elif any(target.startswith(k) for k in KERNEL_TARGETS):
                    out.kernels[ins.name.split(".")[0] if target == "tpu_custom_call" else target] += 1
            elif op == "fusion":
                for callee in _called(ins.attrs, "calls"):
                    out.add(self.costs(callee, kernel_level=False), 1)
            elif op == "while":
                trips = trip_count(ins, self.comps)
                if trips is None:
                    out.unknown_loops += 1
                for body in _called(ins.attrs, "body"):
                    out.add(self.costs(body, kernel_level), trips or 1)
            elif op == "conditional":
                branches = _called(ins.attrs, "branch_computations") or [
                    *_called(ins.attrs, "true_computation"),
                    *_called(ins.attrs, "false_computation"),
                ]
                if branches:
                    out.add(max((self.costs(b, kernel_level) for b in branches), key=lambda c: c.flops), 1)
            elif op in ("call", "async-start"):
                for callee in _called(ins.attrs, "calls") + _called(ins.attrs, "to_apply"):
                    out.add(self.costs(callee, kernel_level), 1)
            base = op.removesuffix("-start")
            if base in COLLECTIVES:
                out.collectives.append((self._collective(base, ins, comp), 1.0))
        return out

    def _traffic(self, ins: Instr, comp: Computation) -> float:
        """Bytes a kernel reads and writes: its operands and outputs, except that an operand a fusion
        only slices (a layer's weights out of the stacked layers, in a scan) counts the slices, and
        an output updated in place (a fusion whose root is a dynamic-update-slice) counts the update."""
        sizes = [shape_bytes(comp.shapes.get(o, "")) for o in ins.operands]
        written = shape_bytes(ins.shape)
        if ins.opcode == "dynamic-slice" and sizes:
            sizes[0] = written
        elif ins.opcode == "dynamic-update-slice" and len(sizes) > 1:
            sizes[0], written = 0.0, sizes[1]
        elif ins.opcode == "fusion":
            fused = self.comps.get(next(iter(_called(ins.attrs, "calls")), ""))
            if fused is not None:
                params = {
                    i.name: int(i.args) for i in fused.instrs if i.opcode == "parameter" and i.args.isdigit()
                }
                users: dict[str, list[Instr]] = {}
                for i in fused.instrs:
                    for o in i.operands:
                        users.setdefault(o, []).append(i)
                for name, k in params.items():
                    used = users.get(name, [])
                    if (
                        k < len(sizes)
                        and used
                        and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in used)
                    ):
                        sizes[k] = min(sizes[k], sum(shape_bytes(u.shape) for u in used))
                root = fused.root
                if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
                    written = shape_bytes(fused.shapes.get(root.operands[1], ""))
                    buffer = root.operands[0]
                    if buffer in params and params[buffer] < len(sizes):
                        sizes[params[buffer]] = 0.0  # aliased in place: not read
        return sum(sizes) + written

    def _collective(self, kind: str, ins: Instr, comp: Computation) -> Collective:
        if kind == "all-reduce" and comp.name.startswith("all-reduce-scatter"):
            # XLA:TPU's reduce-scatter: an all-reduce and a dynamic-slice in one fused computation,
            # run as one reduce-scatter (each device keeps its slice of the sum)
            kind = "reduce-scatter"
        elif kind == "all-reduce" and any("dynamic-update-slice" in o for o in ins.operands):
            # XLA:TPU's all-gather: each device writes its shard into zeros and all-reduces them;
            # it runs (and costs) an all-reduce of the whole gathered array
            kind = "all-gather as all-reduce"
        groups = replica_groups(ins.attrs)
        n_dev = math.prod(self.mesh_axes.values())
        size = 2 if kind == "collective-permute" else (len(groups[0]) if groups else n_dev)
        data = sum(shape_bytes(comp.shapes.get(o, "")) for o in ins.operands)
        frac = (size - 1) / size if size > 1 else 0.0
        wire = {
            "all-reduce": 2 * data * frac,
            "all-gather as all-reduce": 2 * data * frac,
            "all-gather": data * (size - 1),
            "reduce-scatter": data * frac,
            "all-to-all": data * frac,
            "ragged-all-to-all": data * frac,
            "collective-permute": data,
        }[kind]
        crosses = False
        if self.hosts is not None:
            for g in groups or [list(range(n_dev))]:
                if len({self.hosts[i % n_dev] for i in g}) > 1:
                    crosses = True
                    break
        axes = group_axes(groups, self.mesh_axes)
        return Collective(kind, axes, size, 1.0, data, wire, crosses)


def summarize(costs: Costs) -> list[dict]:
    """Collectives grouped by (kind, axes, crosses hosts): count per step, data and wire bytes."""
    table: dict[tuple, dict] = {}
    for c, times in costs.collectives:
        key = (c.kind, c.axes, c.crosses_hosts)
        row = table.setdefault(
            key,
            {"kind": c.kind, "axes": list(c.axes), "crosses_hosts": c.crosses_hosts, "count": 0.0,
             "bytes": 0.0, "wire_bytes": 0.0},
        )  # fmt: skip
        row["count"] += times
        row["bytes"] += c.bytes * times
        row["wire_bytes"] += c.wire_bytes * times
    return sorted(table.values(), key=lambda r: -r["wire_bytes"])


def fingerprint(text: str) -> str:
    """A short stable hash of the compiled module's text (what `--json` records)."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]
