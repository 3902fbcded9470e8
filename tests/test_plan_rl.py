"""`shipyard plan --rl`: the RL trainer's plan plus the rollout engine's KV cache and weights copy
and the KL reference. The byte figures are checked against evidence the planner does not compute:
what the objects `shipyard rl` builds for the same shape hold on the mesh's first device (the rollout
`Engine`'s preallocated cache, the trainer's params, optimizer moments and reference, the engine's
weights; built by the calls rl/loop.py's `run_rl` makes), and, for `tiny`, numbers worked out by
hand from its shape. The plans are analytic only (no train step is compiled)."""

import json

import jax
import jax.numpy as jnp
import pytest

from shipyard.cli.main import main
from shipyard.config import build_rl_config, load_config
from shipyard.plan import DEVICES, _fmt, plan, render, rl_mesh, verdict

RL = ["prompts_per_step=2", "group_size=4", "max_batch=16"]
LORA = "finetune={lora: {rank: 8}}"
LAST = "finetune={train_last_layers: 1, train_head: false}"

# tiny (presets/tiny.yaml) by hand: vocab 512, hidden 64, MLP 192, 2 layers, 4 query heads and 2 KV
# heads of head_dim 64 / 4 = 16, an untied head; data.seq_len 128. Every figure below is worked out
# from those numbers alone.
TINY_LAYER = 2 * 64 + 2 * 64 * 64 + 2 * 64 * (2 * 16) + 3 * 64 * 192  # 2 norms, q o, k v, gate up down
TINY_MODEL = 512 * 64 + 64 * 512 + 64 + 2 * TINY_LAYER  # embedding, head, final norm, 2 layers
TINY_ADAPTERS = 2 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))  # layers x rank x (in + out), q k v o


def tiny_kv(rows: int) -> int:
    """tiny's fp32 KV cache of `rows` rows of data.seq_len = 128 slots: layers x (K, V) x kv_heads x
    head_dim x 4 bytes x slots x rows."""
    return 2 * 2 * 2 * 16 * 4 * 128 * rows


def rl_plan(cfg, *settings):
    rl = build_rl_config([*RL, *settings])
    return plan(cfg, rl_mesh(rl, None), DEVICES["cpu"], with_compiled=False, rl=rl)


def test_tiny_by_hand():
    assert (TINY_LAYER, TINY_MODEL, TINY_ADAPTERS) == (49_280, 164_160, 7_168)
    cfg = load_config("tiny")
    full = rl_plan(cfg, "beta=0.04")
    b = full["bytes"]
    assert b["rollout_kv"] == tiny_kv(16) == 1_048_576  # max_batch=16: 1 MiB
    assert full["rl"]["kv_cache_shape"] == [2, 16, 128, 2, 16]
    # full training on one device: fp32 params, grads and reference, two fp32 AdamW moments; the
    # engine decodes from the trainer's own buffers
    assert b["params"] == b["grads"] == b["reference"] == 4 * TINY_MODEL == 656_640
    assert b["optimizer"] == 8 * TINY_MODEL and b["rollout_params"] == 0
    assert full["params_total"] == TINY_MODEL
    # one update: 2 prompts x 4 replies of data.seq_len tokens at once
    assert full["microbatch_tokens_per_device"] == 8 * 128

    lora = rl_plan(cfg, "beta=0.04", LORA)["bytes"]
    assert lora["reference"] == lora["grads"] == 4 * TINY_ADAPTERS and lora["optimizer"] == 8 * TINY_ADAPTERS
    assert lora["params"] == 4 * (TINY_MODEL + TINY_ADAPTERS)
    assert lora["rollout_params"] == 4 * TINY_MODEL  # the merged weights, a copy of their own
    assert rl_plan(cfg, "beta=0", LORA)["bytes"]["reference"] == 0

    last = rl_plan(cfg, "beta=0.04", LAST)["bytes"]
    assert last["reference"] == last["grads"] == 4 * TINY_LAYER
    assert last["params"] == last["rollout_params"] == 4 * TINY_MODEL

    # two fsdp devices (x 4 data: the 8 test devices): every tiny array has an `embed` axis, which
    # fsdp halves; the engine's cache and weights are whole on the first device
    split = rl_plan(cfg, "beta=0.04", "mesh={data: 4, fsdp: 2}")["bytes"]
    assert split["params"] == split["grads"] == split["reference"] == 4 * TINY_MODEL / 2
    assert split["rollout_params"] == 4 * TINY_MODEL and split["rollout_kv"] == tiny_kv(16)


def held_by_shipyard_rl(cfg, rl) -> dict[str, int]:
    """Bytes on the rl mesh's first device of what `shipyard rl` holds for `cfg`'s model under `rl`,
    built by the calls `run_rl` (rl/loop.py) makes, with data.seq_len as the rollout length (what
    the plan takes it for): the engine's KV cache (`Engine.kv_cache_bytes`), the engine's weights
    that are not the trainer's own buffers, the trainer's params (trainable + frozen), the
    optimizer's moments (its step counter left out) and the KL reference."""
    from model_fixtures import noisy_params

    from shipyard.inference.engine import Engine
    from shipyard.rl.placement import placement_for
    from shipyard.rl.step import build_optimizer, on_policy_model

    length = cfg.data.seq_len
    model = on_policy_model(cfg.model, length)
    params = jax.tree.map(jnp.asarray, noisy_params(cfg.model, key=0, seed=0, scale=0.0))
    place = placement_for(model, rl, length)
    partition = place.partition
    trainable, frozen = place.put(
        partition.initial(params, jax.random.key(rl.seed)), partition.frozen(params)
    )
    engine = Engine(
        place.engine_params(trainable, frozen), model, max_batch=rl.max_batch, max_len=length,
        sampling_logprobs=True, training_numerics=True,
    )  # fmt: skip
    opt_state = build_optimizer(rl).init(trainable)
    reference = jax.tree.map(jnp.copy, trainable) if rl.beta else None
    first = jax.devices()[0] if place.layout is None else place.layout.mesh.devices.flat[0]

    def shards(tree):
        return [s for x in jax.tree.leaves(tree) if x.ndim > 0 for s in x.addressable_shards]

    def on_first(tree, leaving_out=frozenset()) -> int:
        return sum(
            s.data.nbytes
            for s in shards(tree)
            if s.device == first and s.data.unsafe_buffer_pointer() not in leaving_out
        )

    trainer = frozenset(s.data.unsafe_buffer_pointer() for s in shards((trainable, frozen)))
    assert engine.kv_cache_bytes() == on_first(engine._caches)  # the whole cache is on the first device
    return {
        "rollout_kv": engine.kv_cache_bytes(),
        # (on CPU the engine also keeps `decode_weights`, the fused per-layer weights of
        # `cpu_decode.prepare_weights`: one more whole copy of the model, 656,640 bytes for tiny, that
        # the plan does not count; on GPU and TPU the engine decodes from `engine.params` as they are)
        "rollout_params": on_first(engine.params, leaving_out=trainer),
        "params": on_first((trainable, frozen)),
        "optimizer": on_first(opt_state),  # mu and nu; the scalar count is left out
        "reference": on_first(reference),
    }


@pytest.mark.parametrize(
    "settings",
    [
        ["beta=0.04"],
        ["beta=0.04", "mesh={data: 4, fsdp: 2}"],
        ["beta=0.04", LORA],
        ["beta=0.04", LAST],
    ],
    ids=["full", "full on data=4 fsdp=2", "lora", "last layer"],
)
def test_the_planned_bytes_are_what_shipyard_rl_holds(settings):
    cfg = load_config("tiny")
    rl = build_rl_config([*RL, *settings])
    b = rl_plan(cfg, *settings)["bytes"]
    held = held_by_shipyard_rl(cfg, rl)
    assert {k: b[k] for k in held} == held


def test_the_rollout_and_the_reference_add_to_the_trainer_s_total():
    cfg = load_config("tiny")
    b = rl_plan(cfg, "beta=0")["bytes"]
    assert b["reference"] == 0 and b["compute_copy"] == 0  # beta=0 keeps no reference; fp32 compute
    assert b["total"] == sum(
        b[k] for k in ("params", "grads", "optimizer", "activations", "logits", "rollout_kv")
    )
    kept = rl_plan(cfg, "beta=0.04")["bytes"]
    assert kept["total"] == b["total"] + kept["reference"] and kept["reference"] > 0
    text = render(rl_plan(cfg, "beta=0.04"))
    assert "per device (analytic; the mesh's first device, which also hosts the rollout engine):" in text
    assert "rollout KV" in text and "beta=0.04: the starting params" in text
    assert "the starting LoRA adapters" in render(rl_plan(cfg, "beta=0.04", LORA))


def test_a_large_rollout_cache_does_not_fit_where_the_trainer_alone_does(tmp_path, capsys):
    base = [
        "plan",
        "tiny",
        "--mesh",
        "data=1",
        "--device",
        "cpu",
        "--analytic-only",
        "--device-memory",
        "64MiB",
    ]
    assert main(base) == 0
    small = " ".join([*RL, "max_batch=8"])
    assert main([*base, "--rl", small]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "rollout engine and reference included" in out
    big = " ".join([*RL, "max_batch=1024"])
    assert tiny_kv(1024) == 64 * 2**20  # the cache alone is the whole device
    js = tmp_path / "plan.json"
    assert main([*base[:2], *base[4:], "--rl", big, "--json", str(js)]) == 6
    out = capsys.readouterr().out
    assert "verdict: does NOT fit" in out and "lower max_batch" in out
    data = json.loads(js.read_text())
    assert data["fits"] is False and data["bytes"]["rollout_kv"] == 64 * 2**20
    assert data["rl"]["max_batch"] == 1024 and data["rl"]["verdict_bytes"] == data["bytes"]["total"]


def test_the_compiled_peak_is_judged_with_the_engine_and_reference_added():
    cfg = load_config("tiny")
    p = rl_plan(cfg, "beta=0.04", LORA)
    b = p["bytes"]
    engine = b["rollout_kv"] + b["rollout_params"] + b["reference"]
    # A compiled trainer peak that fits by itself, but not beside the engine.
    memory = 100 * 2**20
    peak = 0.9 * memory - engine / 2
    p["compiled"] = {"peak_bytes": peak}
    fits, advice = verdict(p, memory, cfg)
    assert fits is False and "the rollout engine takes" in advice[0]
    # and the text says what was added to XLA's peak (the other compiled figures are placeholders)
    names = ("argument", "params", "optimizer", "temp", "output", "alias")
    p["compiled"].update({f"{k}_bytes": 0 for k in names}, extrapolated=False, flops_per_device=0)
    p.update(fits=fits, advice=advice)
    assert (
        f"not in the compiled trainer step, added to its peak for the verdict) = {_fmt(peak + engine)}"
        in (render(p))
    )
    del p["rl"]  # the same peak without --rl fits
    assert verdict(p, memory, cfg)[0] is True


@pytest.mark.parametrize(
    "rl, says",
    [
        ("max_batch=0", "--rl: invalid rl config: max_batch"),
        ("maxbatch=8", "--rl: invalid rl config: maxbatch: unknown key"),
        ("beta", "--rl: override 'beta'"),
        ("'mesh={fsdp: 2}'", "--rl: mesh.data is -1"),
        (
            "prompts_per_step=3 group_size=3 'mesh={data: 1, fsdp: 2}'",
            "--rl: prompts_per_step x group_size = 9",
        ),
    ],
)
def test_a_bad_rl_value_is_one_line_naming_the_key(rl, says, capsys):
    assert main(["plan", "tiny", "--device", "cpu", "--analytic-only", "--rl", rl]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
