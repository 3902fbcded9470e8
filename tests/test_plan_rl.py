"""`shipyard plan --rl`: the RL trainer's plan plus the rollout engine's KV cache and weights copy
and the KL reference, checked against the model's own sizes (analytic only: no compile)."""

import json

import pytest

from shipyard.cli.main import main
from shipyard.config import build_rl_config, load_config
from shipyard.model.transformer import num_params
from shipyard.plan import DEVICES, _fmt, parse_mesh, plan, render, verdict

ONE = parse_mesh("data=1")
RL = ["prompts_per_step=2", "group_size=4", "max_batch=16"]
LORA = "finetune={lora: {rank: 8}}"


def kv_bytes(cfg, rows: int) -> int:
    """K and V, fp32, for every layer, `rows` cache rows of data.seq_len slots."""
    m = cfg.model
    return 2 * m.num_layers * rows * cfg.data.seq_len * m.num_kv_heads * m.head_dim * 4


def rl_plan(cfg, *settings, sizes=ONE):
    return plan(cfg, sizes, DEVICES["cpu"], with_compiled=False, rl=build_rl_config([*RL, *settings]))


def test_rollout_cache_and_the_reference_are_counted_on_the_first_device():
    cfg = load_config("tiny")
    n = num_params(cfg.model)
    none = rl_plan(cfg, "beta=0")
    b = none["bytes"]
    assert b["rollout_kv"] == kv_bytes(cfg, 16)
    assert b["reference"] == 0 and b["rollout_params"] == 0  # full training, one device: shared weights
    # the trainer's step: 2 x 4 replies of data.seq_len tokens at once, fp32 AdamW state
    assert none["microbatch_tokens_per_device"] == 8 * cfg.data.seq_len
    assert (b["params"], b["grads"], b["optimizer"], b["compute_copy"]) == (4 * n, 4 * n, 8 * n, 0)

    kept = rl_plan(cfg, "beta=0.04")["bytes"]
    assert kept["reference"] == 4 * n  # an fp32 copy of the starting params
    assert kept["total"] == b["total"] + 4 * n
    assert (
        b["total"]
        == sum(b[k] for k in ("params", "grads", "optimizer", "activations", "logits")) + (b["rollout_kv"])
    )
    text = render(rl_plan(cfg, "beta=0.04"))
    assert "per device (analytic; the mesh's first device, which also hosts the rollout engine):" in text
    assert "rollout KV" in text and "beta=0.04: the starting params" in text

    # Two fsdp devices: the reference is sharded like the params; the engine's device holds a full copy.
    split = rl_plan(cfg, "beta=0.04", "mesh={data: 1, fsdp: 2}", sizes=parse_mesh("fsdp=2"))
    s = split["bytes"]
    assert s["reference"] == s["grads"] < 4 * n and s["rollout_params"] == 4 * n
    assert s["rollout_kv"] == kv_bytes(cfg, 16)  # the engine's cache is not split


def test_lora_keeps_an_adapter_sized_reference_and_a_full_rollout_copy():
    cfg = load_config("tiny")
    m, r = cfg.model, 8
    E, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    # A [in, r] and B [r, out] on q, k, v and o of every layer
    adapters = m.num_layers * r * ((E + q) + 2 * (E + kv) + (q + E))
    lora = rl_plan(cfg, "beta=0.04", LORA)
    b = lora["bytes"]
    assert b["reference"] == 4 * adapters == b["grads"]
    assert b["rollout_params"] == 4 * num_params(m)  # the merged weights, a copy of their own
    assert rl_plan(cfg, "beta=0", LORA)["bytes"]["reference"] == 0
    assert "the starting LoRA adapters" in render(lora)
    # train_last_layers: a copy of the trained layer (norms, attention, MLP)
    I = m.intermediate_size
    layer = 2 * E + E * q + 2 * E * kv + q * E + 3 * E * I
    last = rl_plan(cfg, "beta=0.04", "finetune={train_last_layers: 1, train_head: false}")["bytes"]
    assert last["reference"] == 4 * layer and last["rollout_params"] == 4 * num_params(m)


def test_a_large_rollout_cache_does_not_fit_where_the_trainer_alone_does(tmp_path, capsys):
    cfg = load_config("tiny")
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
    assert kv_bytes(cfg, 1024) == 64 * 2**20  # the cache alone is the whole device
    js = tmp_path / "plan.json"
    assert main([*base[:2], *base[4:], "--rl", big, "--json", str(js)]) == 6
    out = capsys.readouterr().out
    assert "verdict: does NOT fit" in out and "lower max_batch" in out
    data = json.loads(js.read_text())
    assert data["fits"] is False and data["bytes"]["rollout_kv"] == kv_bytes(cfg, 1024)
    assert data["rl"]["max_batch"] == 1024 and data["rl"]["verdict_bytes"] == data["bytes"]["total"]


def test_the_compiled_peak_is_judged_with_the_engine_and_reference_added():
    cfg = load_config("tiny")
    rl = build_rl_config([*RL, "beta=0.04", LORA])
    p = plan(cfg, ONE, DEVICES["cpu"], with_compiled=False, rl=rl)
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
