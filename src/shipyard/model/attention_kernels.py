"""Vendor attention kernels for training: cuDNN flash attention (GPU) and Pallas splash attention (TPU).

Both take the grouped layout of `model.attention` (q [batch, T, kv_heads,
group, D], k and v [batch, T, kv_heads, D]) and compute causal self-attention
over one sequence. Their masks are static (a kernel is specialised to them),
so a per-layer window, traced under `lax.scan`, is resolved by a `lax.cond`
between the local and the global kernel. `unsupported_*` say, in one line, why
a kernel cannot run a configuration (None when it can): `attention` refuses
with it for an explicit choice and `auto` falls back to blocked attention.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
SPLASH_MULTIPLE = 128
"""Splash attention's smallest tile: sequence lengths must be a multiple of it."""


def unsupported_cudnn(backend: str, dtype, head_dim: int, segments: bool) -> str | None:
    """Why cuDNN flash attention cannot run this (None when it can)."""
    if backend != "gpu":
        return f"cudnn needs a CUDA GPU, this backend is {backend}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"cudnn flash attention runs in bfloat16 or float16, not {jnp.dtype(dtype).name} (train.precision)"
    if head_dim % 8 or head_dim > 256:
        return f"cudnn needs head_dim a multiple of 8 and at most 256, got {head_dim}"
    if segments:
        # jax.nn.dot_product_attention takes padding lengths but no segment ids; a [T, T] mask would
        # bring back the matrix this kernel exists to avoid.
        return "cudnn (jax.nn.dot_product_attention) cannot mask packed documents by segment ids"
    return None


def unsupported_splash(backend: str, seq_len: int) -> str | None:
    """Why splash attention cannot run this (None when it can)."""
    if backend != "tpu":
        return f"splash is a TPU kernel, this backend is {backend}"
    if seq_len % SPLASH_MULTIPLE:
        return f"splash needs data.seq_len a multiple of {SPLASH_MULTIPLE}, got {seq_len}"
    return None


def _by_window(kernel, window, static_window: int | None, global_window: int):
    """kernel(w) with w the static window the traced `window` holds: the local one or None (global)."""
    if window is None or static_window is None:
        return kernel(None)
    if isinstance(window, int):
        return kernel(None if window >= global_window else window)
    return jax.lax.cond(window < global_window, lambda: kernel(static_window), lambda: kernel(None))


def cudnn_attention(
    q,
    k,
    v,
    window=None,
    static_window: int | None = None,
    global_window: int = 2**30,
    implementation="cudnn",
    layout=None,
):
    """Causal cuDNN flash attention; `window` is None, an int or a traced int equal to `static_window`
    or to `global_window` (global). `implementation="xla"` runs the same call through XLA (tests).
    With a `layout` of more than one device, each device runs it on its own rows and heads
    (`_per_device`): the call's own partitioning rule fails inside a pipeline stage's shard_map
    (jax 0.10.2: "'GSPMDSharding' object has no attribute 'spec'", from a 535B compile for H200s)."""
    if layout is not None and layout.mesh.size > 1:
        return _per_device(
            layout,
            lambda q, k, v, s, w: cudnn_attention(q, k, v, w, static_window, global_window, implementation),
            q,
            k,
            v,
            None,
            window,
        )
    B, T, K, G, D = q.shape

    def kernel(w):
        out = jax.nn.dot_product_attention(
            q.reshape(B, T, K * G, D),  # query head n uses KV head n // G, as the grouped layout has it
            k,
            v,
            is_causal=True,
            # (left, right): a query sees itself and the w - 1 positions before it
            local_window_size=None if w is None or w >= T else (w - 1, 0),
            implementation=implementation,
        )
        return out.reshape(B, T, K, G, D)

    return _by_window(kernel, window, static_window, global_window)


def splash_attention(
    q,
    k,
    v,
    segment_ids=None,
    window=None,
    static_window: int | None = None,
    global_window: int = 2**30,
    block: int = 512,
    interpret: bool = False,
    layout=None,
):
    """Causal Pallas splash attention (per batch row, heads grouped as GQA); `interpret` runs the kernel
    in the Pallas interpreter (any backend: for tests). With a `layout` (parallel/layout.py) of more
    than one device, each device runs the kernel on its own rows and heads (`_per_device`)."""
    if layout is not None and layout.mesh.size > 1:
        return _per_device(
            layout,
            lambda q, k, v, s, w: splash_attention(
                q, k, v, s, w, static_window, global_window, block, interpret
            ),
            q,
            k,
            v,
            segment_ids,
            window,
        )
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, K, G, D = q.shape
    size = math.gcd(block, T)  # tiles must divide the sequence
    sizes = splash.BlockSizes(
        block_q=size,
        block_kv=size,
        block_kv_compute=size,
        block_q_dkv=size,
        block_kv_dkv=size,
        block_kv_dkv_compute=size,
        block_q_dq=size,
        block_kv_dq=size,
    )
    # splash does not scale the scores: scale the queries instead
    qh = (q * (1.0 / math.sqrt(D))).astype(q.dtype).reshape(B, T, K * G, D).transpose(0, 2, 1, 3)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def kernel(w):
        if w is None or w >= T:
            head = splash.CausalMask((T, T))
        else:
            head = splash.LocalMask((T, T), window_size=(w - 1, 0), offset=0)
        fn = splash.make_splash_mha(
            splash.MultiHeadMask([head] * (K * G)),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )
        if segment_ids is None:
            out = jax.vmap(fn)(qh, kh, vh)
        else:
            seg = segment_ids.astype(jnp.int32)
            out = jax.vmap(lambda a, b, c, s: fn(a, b, c, segment_ids=splash.SegmentIds(s, s)))(
                qh, kh, vh, seg
            )
        return out.transpose(0, 2, 1, 3).reshape(B, T, K, G, D)

    return _by_window(kernel, window, static_window, global_window)


def _per_device(layout, fn, q, k, v, segment_ids, window):
    """fn(q, k, v, segment_ids, window) on each device's rows and KV heads, in a shard_map: XLA cannot
    split a Mosaic kernel over devices itself ("Mosaic kernels cannot be automatically partitioned").
    The sequence is whole here (context parallelism runs the ring instead), so the split is batch and
    heads, as the sharding rules lay them out; inside a pipeline stage the nested shard_map takes
    the stage's context mesh. The window (a traced per-layer size under the layer scan) goes in as
    an argument, replicated: a value the body closed over would carry the outer context's mesh."""
    from shipyard.parallel.mesh import logical_to_pspec
    from shipyard.parallel.pipeline import nested_mesh

    mesh, axes = nested_mesh(layout.mesh)
    rules = {name: tuple(a for a in targets if a in axes) for name, targets in layout.rules.items()}
    qs = logical_to_pspec(("batch", None, "kv_heads", None, None), q.shape, layout.mesh, rules)
    ks = PartitionSpec(*qs[:3], None)
    seg = None if segment_ids is None else PartitionSpec(qs[0], None)
    win = None if window is None or isinstance(window, int) else PartitionSpec()
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(qs, ks, ks, seg, win), out_specs=qs, axis_names=set(axes), check_vma=False
    )(q, k, v, segment_ids, window)
