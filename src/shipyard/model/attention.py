"""Attention, written once: q/k/v projection, RoPE, masks, the score/softmax/value core, the KV-cache update.

The training forward (`transformer.attention_sublayer`, through `causal_self_attention`, whose core
`causal_attention` picks per `model.attention_impl`: this module's reference `attend`, the blocked
flash-style `model.blocked_attention`, or a vendor kernel of `model.attention_kernels`), the KV-cache forward
(`inference.decode.forward_cached`) and the CPU decode step
(`inference.cpu_decode`) all call these functions; they differ only in where
keys and values come from (this chunk, or a cache) and in how a cache is laid
out in memory (`CacheLayout`).

Shapes: queries are grouped by the KV head they share, q [batch, T, kv_heads,
group, head_dim], so KV is never repeated; new keys and values are [batch, T,
kv_heads, head_dim]. Scores and softmax are fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.errors import ConfigError
from shipyard.model import attention_kernels, blocked_attention, layers, quant
from shipyard.model.lora import LoraParams, delta
from shipyard.parallel import backend

GLOBAL_WINDOW = 2**30
"""The window of a global layer where windows are per-layer arrays: no sequence reaches it."""
BLOCKED_FROM_SEQ = 1024
"""On CPU, `auto` attention is blocked from this sequence length on, reference below it. Measured by
bench/attention_memory.py (one attention core's forward + backward, two noisy runs): blocked is
1.35-1.7x faster at 1K and 2.7-4x at 2K; at 512 and below the sequence is one tile and the two are
within noise, so short sequences keep today's path exactly."""


class AttentionWeights(NamedTuple):
    """One block's attention weights (or a stack's, with a leading `layers` axis), q|k|v fused per KV head."""

    qkv: jax.Array | tuple[jax.Array, jax.Array, jax.Array]
    """[embed, kv_heads, group + 2, head_dim]: per KV head its group of query heads, then k, then v. Or
    its three parts along the group axis (q [embed, kv_heads, group, head_dim], k and v [..., 1, head_dim]):
    then the three projections run apart and their outputs are concatenated instead of the weights."""
    qkv_bias: jax.Array | None
    """[kv_heads, group + 2, head_dim] (qkv_bias models only)."""
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    wo: jax.Array
    """[heads * head_dim, embed]"""
    lora: LoraParams | None = None


class CacheLayout(NamedTuple):
    """Axis order of cached keys and values, as einsum subscripts over b (batch), s (slot), k (KV head), d;
    and which operand of the two attention products comes first (see `contract`)."""

    k: str
    v: str
    cache_first: bool
    """Keys / values as the left operand: the order jnp.einsum picks, which training's numerics have always
    had. With queries / probabilities on the left, a head-major cache makes both products plain batched
    matmuls (keys or values on the left there cost transposed copies of the queries and of the output)."""


SEQ_MAJOR = CacheLayout("bskd", "bskd", cache_first=True)
"""The layout of new keys and values and of `KVCache` layers."""
HEAD_MAJOR = CacheLayout("bkds", "bksd", cache_first=False)
"""Keys transposed, values head-major: for one query per row both attention products are plain
batched matmuls over the cache with no copy of it (the CPU decode step)."""


class LayerKV(NamedTuple):
    """One layer's cached keys and values, laid out per a `CacheLayout`, `max_len` slots."""

    k: jax.Array
    v: jax.Array


def qkv_parts(q, k, v, num_kv_heads: int) -> tuple:
    """q [..., heads, D], k and v [..., kv_heads, D] -> [..., kv_heads, group, D], [..., kv_heads, 1, D] (twice).

    Arrays or int8 `quant.QuantizedMatrix` weights (values and scales are regrouped alike).
    """

    def group(a):
        return a.reshape(*a.shape[:-2], num_kv_heads, a.shape[-2] // num_kv_heads, a.shape[-1])

    def single(a):
        return a[..., None, :]

    return quant.apply(group, q), quant.apply(single, k), quant.apply(single, v)


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, num_kv_heads: int) -> jax.Array:
    """q [..., heads, D], k and v [..., kv_heads, D] -> [..., kv_heads, group + 2, D].

    kv_heads stays outermost, so a kv_heads / heads sharding survives the concatenation.
    Quantized weights concatenate their int8 values and their per-output-channel scales alike.
    """
    return quant.apply(lambda *parts: jnp.concatenate(parts, axis=-2), *qkv_parts(q, k, v, num_kv_heads))


def attention_weights(p, num_kv_heads: int, fused: bool = True) -> AttentionWeights:
    """`AttentionWeights` of a block's (or a stack's) per-projection weights (`transformer.BlockParams`).

    Training calls this per layer inside the forward pass, so the stored
    layout (and its shardings) stays per projection and only the fused copy
    is made. `fused=False` keeps q, k and v apart (no copy at all): for steps
    over a few tokens, where copying the weights would cost more than the
    two extra matmul calls.
    """
    bias = None if p.bq is None else fuse_qkv(p.bq, p.bk, p.bv, num_kv_heads)
    wo = quant.apply(lambda a: a.reshape(*a.shape[:-3], -1, a.shape[-1]), p.wo)
    qkv = (fuse_qkv if fused else qkv_parts)(p.wq, p.wk, p.wv, num_kv_heads)
    return AttentionWeights(qkv, bias, p.q_norm, p.k_norm, wo, p.lora)


def project_qkv(cfg: ModelConfig, h: jax.Array, w: AttentionWeights, key=None):
    """Normed input h [batch, T, embed] -> q [batch, T, kv_heads, group, D], k and v [batch, T, kv_heads, D].

    One matmul for Q, K and V (with fused weights): wider matmuls run far closer to peak on CPU.
    Adds biases, LoRA deltas (`key`: LoRA dropout) and the q/k RMSNorms, before RoPE.
    """
    parts = w.qkv if isinstance(w.qkv, tuple) else (w.qkv,)

    def matrix(a):  # [embed, kv_heads, n, D] -> [embed, kv_heads * n * D], int8 values and scales alike
        return quant.apply(lambda t: t.reshape(t.shape[0], -1), a)

    out = [layers.dense(h, matrix(a)).reshape(*h.shape[:2], *a.shape[1:]) for a in parts]
    qkv = out[0] if len(out) == 1 else jnp.concatenate(out, axis=-2)
    G = qkv.shape[-2] - 2
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    q, k, v = qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if w.lora is not None:
        q = layers.add_optional(q, delta(w.lora, "q", h, key))
        k = layers.add_optional(k, delta(w.lora, "k", h, key))
        v = layers.add_optional(v, delta(w.lora, "v", h, key))
    if w.q_norm is not None:
        q = layers.rms_norm(q, w.q_norm, cfg.norm_eps)
        k = layers.rms_norm(k, w.k_norm, cfg.norm_eps)
    return q, k, v


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin for RoPE positions [batch or 1, T] (Llama-3 scaling when the config has it)."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return layers.rope_cos_sin(positions, inv_freq)


def mask(
    q_slots: jax.Array,
    k_slots: jax.Array,
    window=None,
    segment_ids: jax.Array | None = None,
    first_key: jax.Array | None = None,
) -> jax.Array:
    """Which keys each query sees: bool [batch or 1, T, S].

    q_slots [T] (or [batch, T], each row at its own cache positions) and
    k_slots [S] are sequence (or cache) positions. Causal; `window`
    (optional; a traced per-layer size under scan, >= the sequence means
    global) keeps the last `window` positions; `segment_ids` [batch, T]
    (T == S) stop attention across packed documents; `first_key` [batch]
    hides keys before each row's first real token (left padding).
    """
    q = q_slots[None, :, None] if q_slots.ndim == 1 else q_slots[:, :, None]
    seen = k_slots <= q
    if window is not None:
        seen = seen & (q - k_slots < window)
    if first_key is not None:
        seen = seen & (k_slots[None, None, :] >= first_key[:, None, None])
    if segment_ids is not None:
        seen = seen & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return seen


def contract(x: jax.Array, x_spec: str, y: jax.Array, y_spec: str, out_spec: str, **kw) -> jax.Array:
    """jnp.einsum(f"{x_spec},{y_spec}->{out_spec}", x, y) with x as dot_general's left operand.

    jnp.einsum picks the operand order itself; otherwise this builds what it
    does (batch dimensions in the output's order, the result dtype as the
    preferred element type, then one transpose to `out_spec`).
    """
    batch = [c for c in out_spec if c in x_spec and c in y_spec]
    summed = [c for c in x_spec if c in y_spec and c not in out_spec]
    summed_dims = ([x_spec.index(c) for c in summed], [y_spec.index(c) for c in summed])
    batch_dims = ([x_spec.index(c) for c in batch], [y_spec.index(c) for c in batch])
    kw.setdefault("preferred_element_type", jnp.result_type(x, y))
    out = jax.lax.dot_general(x, y, (summed_dims, batch_dims), **kw)
    got = batch + [c for c in x_spec if c not in y_spec] + [c for c in y_spec if c not in x_spec]
    return out if got == list(out_spec) else out.transpose([got.index(c) for c in out_spec])


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array, layout: CacheLayout = SEQ_MAJOR, ordered=False
):
    """Softmax(q k^T / sqrt(D)) v over the keys `seen` [batch or 1, T, S] allows: [batch, T, kv_heads, group, D].

    q [batch, T, kv_heads, group, D]; k and v laid out per `layout`. `ordered`: the same softmax
    summed in key order (`model.attention_impl: ordered`, `_attend_ordered`).
    """

    def product(a, a_spec, b, b_spec, out_spec, **kw):
        if layout.cache_first:
            return contract(b, b_spec, a, a_spec, out_spec, **kw)
        return contract(a, a_spec, b, b_spec, out_spec, **kw)

    if ordered:
        return _attend_ordered(q, k, v, seen, layout, product)
    scores = product(q, "btkgd", k, layout.k, "bkgts", preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(q.shape[-1]))
    scores = jnp.where(seen[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return product(probs, "bkgts", v, layout.v, "btkgd")


def _attend_ordered(q, k, v, seen, layout: CacheLayout, product):
    """`attend` with every sum over keys taken in key order, the same bits whatever the sequence.

    The keys are taken in blocks of KEY_BLOCK (the last one padded with masked keys), the softmax's
    denominator is a matrix product like the values' (normalised after it), and the blocks' results
    are added in key order. On CPU a product sums a block's terms in key order whatever the number
    of keys, queries or masked slots around them (a masked key adds an exact 0), where a reduce sums
    in lanes that depend on them and a longer product is cut up by its sizes. So the serving engine's
    steps over a cache and the trainer's forward over the whole sequence compute each query's
    attention bit for bit alike (RL's on-policy check, tests/test_rl.py), if their rows start at the
    same slot. On CPU it costs about half again the reference core's time under YNNPACK fusions
    (a sixth without them): RL opts in, training does not.
    """
    S = seen.shape[-1]
    c = min(S, KEY_BLOCK)
    n = -(-S // c)
    if n * c > S:  # pad the last block with masked keys
        k, v = (_pad_slots(x, spec, n * c) for x, spec in ((k, layout.k), (v, layout.v)))
        seen = jnp.pad(seen, ((0, 0), (0, 0), (0, n * c - S)))
    k, v = _split_slots(k, layout.k, n, c), _split_slots(v, layout.v, n, c)
    k_spec, v_spec = layout.k.replace("s", "nc"), layout.v.replace("s", "nc")
    seen = seen.reshape(*seen.shape[:2], n, c).transpose(0, 2, 1, 3)[:, None, :, None]  # b 1 n 1 t c
    scores = product(q, "btkgd", k, k_spec, "bkngtc", preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(q.shape[-1]))
    scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=(2, 5), keepdims=True))
    weights = jnp.exp(scores - top)
    ones = jnp.ones((c, 2), weights.dtype)  # (one column would make it a reduce again)
    total = contract(weights, "bkngtc", ones, "cx", "bkngtx")[..., :1]
    # (each block's result in fp32, so low-precision values round once, after the blocks are added)
    out = product(weights.astype(v.dtype), "bkngtc", v, v_spec, "bkngtd", preferred_element_type=jnp.float32)
    out = jnp.sum(out, axis=2) / jnp.sum(total, axis=2)  # blocks in key order
    return out.transpose(0, 3, 1, 2, 4).astype(v.dtype)


KEY_BLOCK = 64
"""Keys per block of `attend`'s products: short enough that no CPU product of one block is cut up
along the keys (products of about 100 keys and more were, depending on their other sizes)."""


def _pad_slots(x: jax.Array, spec: str, slots: int) -> jax.Array:
    """x (axes named by `spec`) with zeros after its slots ("s") up to `slots`."""
    widths = [(0, 0)] * x.ndim
    at = spec.index("s")
    widths[at] = (0, slots - x.shape[at])
    return jnp.pad(x, widths)


def _split_slots(x: jax.Array, spec: str, n: int, c: int) -> jax.Array:
    """x with its slot axis ("s" in `spec`) split into n blocks of c."""
    at = spec.index("s")
    return x.reshape(*x.shape[:at], n, c, *x.shape[at + 1 :])


def attention_impl(cfg: ModelConfig, backend: str, seq_len: int, dtype, segments: bool) -> str:
    """The training attention core `cfg.attention_impl` resolves to on `backend` ("cpu", "gpu", "tpu")
    for this sequence length, compute dtype and segment ids (present or not).

    An explicit cudnn or splash that cannot run raises ConfigError saying why; `auto` falls back to
    blocked attention instead.
    """
    impl = cfg.attention_impl
    why = {
        "cudnn": lambda: attention_kernels.unsupported_cudnn(backend, dtype, cfg.head_dim, segments),
        "splash": lambda: attention_kernels.unsupported_splash(backend, seq_len),
    }
    if impl in why:
        reason = why[impl]()
        if reason is not None:
            raise ConfigError(f"model.attention_impl: {reason}; use blocked (any backend) or auto")
        return impl
    if impl != "auto":
        return impl
    if backend == "gpu":
        return "cudnn" if why["cudnn"]() is None else "blocked"
    if backend == "tpu":
        return "splash" if why["splash"]() is None else "blocked"
    return "reference" if seq_len < BLOCKED_FROM_SEQ else "blocked"


def causal_attention(
    cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids=None, window=None, layout=None
):
    """Causal self-attention over one sequence by the core `attention_impl` picks: [batch, T, kv_heads, group, D].

    q [batch, T, kv_heads, group, D], k and v [batch, T, kv_heads, D];
    `segment_ids` [batch, T] (packed documents) and `window` (a traced
    per-layer size under scan, GLOBAL_WINDOW or more meaning global) as in
    `mask`. Only reference builds the [T, T] mask and scores.
    """
    T = q.shape[1]
    impl = attention_impl(cfg, backend.platform(), T, q.dtype, segment_ids is not None)
    if impl in ("reference", "ordered"):
        slots = jnp.arange(T)
        return attend(q, k, v, mask(slots, slots, window, segment_ids), ordered=impl == "ordered")
    if impl == "blocked":
        return blocked_attention.attention(q, k, v, segment_ids, window, block=cfg.attention_block)
    if impl == "cudnn":
        return attention_kernels.cudnn_attention(
            q, k, v, window, cfg.sliding_window, GLOBAL_WINDOW, layout=layout
        )
    return attention_kernels.splash_attention(
        q, k, v, segment_ids, window, cfg.sliding_window, GLOBAL_WINDOW, cfg.attention_block, layout=layout
    )


def update_cache(cache: LayerKV, k: jax.Array, v: jax.Array, pos, layout: CacheLayout = SEQ_MAJOR) -> LayerKV:
    """Write new keys and values [batch, T, kv_heads, D] into cache slots pos..pos+T-1 (in place under donation).

    `pos` is one slot for all rows, or [batch] slots (rows of a continuously
    batched cache, each at its own position).
    """

    def put(buf, new, spec):
        new = new.transpose([SEQ_MAJOR.k.index(c) for c in spec]).astype(buf.dtype)
        slot = spec.index("s")
        if jnp.ndim(pos) == 0:
            return jax.lax.dynamic_update_slice(buf, new, [pos if i == slot else 0 for i in range(4)])

        def row(b, n, p):  # batch is the first axis of every layout
            return jax.lax.dynamic_update_slice(b, n, [p if i == slot - 1 else 0 for i in range(3)])

        return jax.vmap(row)(buf, new, pos)

    return LayerKV(put(cache.k, k, layout.k), put(cache.v, v, layout.v))


def project_out(w: AttentionWeights, attn: jax.Array, key=None) -> jax.Array:
    """Attention outputs [batch, T, kv_heads, group, D] -> [batch, T, embed] (plus the LoRA delta)."""
    attn = attn.reshape(*attn.shape[:2], -1)
    out = layers.dense(attn, w.wo)
    if w.lora is not None:
        out = layers.add_optional(out, delta(w.lora, "o", attn, key))
    return out


def self_attention(
    cfg: ModelConfig,
    h: jax.Array,
    w: AttentionWeights,
    cos: jax.Array,
    sin: jax.Array,
    seen: jax.Array,
    *,
    key=None,
    cache: LayerKV | None = None,
    pos=None,
    layout: CacheLayout = SEQ_MAJOR,
) -> tuple[jax.Array, LayerKV | None]:
    """The attention branch for normed input h [batch, T, embed]: (output [batch, T, embed], cache).

    Without a cache, queries attend to this chunk's keys; with one, the new
    keys and values are written at slots pos..pos+T-1 first and queries
    attend over the whole cache (`seen` over its slots).
    """
    q, k, v = project_qkv(cfg, h, w, key)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    if cache is not None:
        cache = update_cache(cache, k, v, pos, layout)
        k, v = cache
    out = attend(q, k, v, seen, layout, ordered=cfg.attention_impl == "ordered")
    return project_out(w, out, key), cache


def causal_self_attention(
    cfg: ModelConfig,
    h: jax.Array,
    w: AttentionWeights,
    cos,
    sin,
    segment_ids=None,
    window=None,
    key=None,
    layout=None,
) -> jax.Array:
    """The training attention branch for normed input h [batch, T, embed]: [batch, T, embed].

    As `self_attention` without a cache, with the core chosen by
    `causal_attention` from slots, segment ids and window (no [T, T] mask
    unless the core is reference).
    """
    q, k, v = project_qkv(cfg, h, w, key)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    return project_out(w, causal_attention(cfg, q, k, v, segment_ids, window, layout), key)


def layer_window_sizes(cfg: ModelConfig) -> list[int | None]:
    """Each layer's attention window, None where it attends globally (every `global_attention_every`-th)."""
    every = cfg.global_attention_every
    return [
        None
        if cfg.sliding_window is None or (every is not None and (i + 1) % every == 0)
        else cfg.sliding_window
        for i in range(cfg.num_layers)
    ]


def layer_windows(cfg: ModelConfig) -> list[jax.Array | None]:
    """Per stack (dense layers, then MoE layers), each layer's window as an int array for `lax.scan`,
    or None when no layer is local. Global layers get `GLOBAL_WINDOW`."""
    if cfg.sliding_window is None:
        return [None, None]
    sizes = [GLOBAL_WINDOW if w is None else w for w in layer_window_sizes(cfg)]
    d = cfg.num_dense_layers
    return [jnp.asarray(w, jnp.int32) for w in (sizes[:d], sizes[d:]) if w]
