"""The planner: analytic vs compiled vs measured memory, the seed arithmetic, verdicts and CLI errors."""

import json

import pytest

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.errors import ConfigError
from shipyard.model.transformer import num_active_params, num_params
from shipyard.plan import DEVICES, measured_peak, parse_bytes, parse_mesh, plan, render

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

ONE = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}


def test_seed_arithmetic_and_the_planners_own_terms():
    cfg = load_config("marin-8b")
    n = num_params(cfg.model)
    # The seeds' figure: bf16 params and grads, fp32 Adam moments, nothing sharded.
    assert n * (2 + 2 + 8) / 1e9 == pytest.approx(96, rel=0.01)
    p = plan(cfg, ONE, DEVICES["h100"], with_compiled=False)
    assert p["bytes_per_param"] == {"params": 4.0, "grads": 4.0, "optimizer": 8.0}
    b = p["bytes"]
    assert (b["params"], b["grads"], b["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert b["compute_copy"] == 2 * n  # the bf16 copy the step computes with
    # and it explains itself in those terms: fp32 master params make the grads fp32 too.
    text = render(p)
    assert f"{n:,} x 16 B = {n * 16 / 1e9:,.1f} GB" in text and "fp32 master" in text


def test_marin_8b_fsdp8_analytic_and_compiled_agree_on_state_bytes():
    cfg = load_config("marin-8b", ["model.remat=full", "train.global_batch_size=8", "train.microbatches=1"])
    p = plan(cfg, {**ONE, "fsdp": 8}, DEVICES["h100"], tokens=15e12)
    c = p["compiled"]
    analytic = p["bytes"]["params"] + p["bytes"]["optimizer"]
    compiled = c["params_bytes"] + c["optimizer_bytes"]
    assert compiled == pytest.approx(analytic, rel=0.15)
    assert p["bytes"]["params"] == pytest.approx(4 * num_params(cfg.model) / 8)
    assert c["argument_bytes"] >= compiled  # the state is the step's argument (plus the batch)
    assert p["days"] > 0 and p["device_hours"] == pytest.approx(p["days"] * 24 * 8)
    assert p["fits"], p["advice"]


@pytest.mark.parametrize(
    "name, overrides",
    # small's width (384 wide, 8192-token vocabulary, 256-token rows) on 2 of its 6 layers, without
    # its unrolled scan: each layer is the same scanned block, so 2 exercise what 6 do (the scan's
    # carry, remat's saved residuals). 2 cores: 22 s and 16 s a case against 31 s and 24 s with 6
    # layers (6 unrolled: 40 s more); the rest is the two child processes' start-up and compiles
    [
        ("tiny", []),
        ("small", ["model.scan_unroll=1", "model.num_layers=2"]),
        ("small", ["model.scan_unroll=1", "model.num_layers=2", "model.remat=full"]),
    ],
)
def test_predicted_peak_is_within_25_percent_of_a_measured_step(name, overrides):
    cfg = load_config(name, overrides)
    p = plan(cfg, ONE, DEVICES["cpu"])
    measured = measured_peak(cfg)["peak_bytes"]
    assert p["compiled"]["peak_bytes"] == pytest.approx(measured, rel=0.25)


FSDP_EXPERT = ["train.pipeline=null", "train.microbatches=16"]
"""The 535B preset on the layout that fitted before pipelines: fsdp=32 x expert=8, 16 microbatches."""


def test_moe_535b_analytic_on_256_devices_reports_total_and_active():
    cfg = load_config("moe-535b-a23b", FSDP_EXPERT)
    p = plan(cfg, {**ONE, "fsdp": 32, "expert": 8}, DEVICES["h100"], tokens=15e12, with_compiled=False)
    assert p["params_total"] == num_params(cfg.model) and p["params_active"] == num_active_params(cfg.model)
    assert p["devices"] == 256
    # Experts are split 8 ways and everything else 32 ways over fsdp: far below 1/32 of 16 B/param.
    assert p["bytes"]["params"] < 4 * p["params_total"] / 32
    # Dropless on GPUs, the blocked expert compute's gathered weights do not fit in 80 GiB; capacity
    # mode, which gathers none, does.
    assert not p["fits"]
    capped = load_config("moe-535b-a23b", [*FSDP_EXPERT, "model.moe.capacity_factor=1.25"])
    q = plan(capped, {**ONE, "fsdp": 32, "expert": 8}, DEVICES["h100"], tokens=15e12, with_compiled=False)
    assert q["fits"], q["advice"]


def test_dropless_moe_off_tpu_counts_the_blocked_compute_s_gathered_weights():
    """Each block of the blocked expert compute gathers its expert's three weight matrices: on the
    535B recipe on H200s 800 blocks (32 sequences' 196,608 expert rows over 32 local experts, blocks
    of 256) x 6144 x 2176 x 2 B = 21.4 GB a matrix, XLA:GPU's loop_gather_fusion buffers. The layer's
    backward recomputes the three, then makes each one's gradient: four at the peak. TPU runs
    ragged_dot, a grouped-matmul kernel that gathers nothing."""
    mesh = {**ONE, "pipeline": 3, "fsdp": 64, "expert": 8}
    one_matrix = 800 * 6144 * 2176 * 2

    def activations(device, *overrides):
        cfg = load_config("moe-535b-a23b", list(overrides))
        return plan(cfg, mesh, device, with_compiled=False)["bytes"]["activations"]

    blocked = activations(DEVICES["h200"])
    ragged = activations(DEVICES["h200"], "model.moe.grouped_matmul=ragged")
    # the MoE layer is the largest either way: its backward grows by the four matrices exactly
    assert blocked - ragged == pytest.approx(4 * one_matrix, rel=1e-6)
    assert activations(DEVICES["tpu-v5p"]) == pytest.approx(ragged, rel=1e-6)
    assert activations(DEVICES["h200"], "model.moe.capacity_factor=1.25") < ragged


@pytest.mark.slow
def test_moe_535b_compiled_on_reduced_layers_extrapolates():
    cfg = load_config("moe-535b-a23b", FSDP_EXPERT)
    p = plan(cfg, {**ONE, "fsdp": 32, "expert": 8}, DEVICES["h200"], compile_layers=1)
    c = p["compiled"]
    assert c["extrapolated"] and c["compiled_layers"] == [5, 6] and c["moe_stand_in"]
    analytic = p["bytes"]["params"] + p["bytes"]["optimizer"]
    assert c["params_bytes"] + c["optimizer_bytes"] == pytest.approx(analytic, rel=0.15)
    assert "extrapolated from 5 and 6 layers" in render(p)


def test_verdict_says_what_to_change():
    cfg = load_config("marin-8b", ["model.remat=none"])
    p = plan(cfg, {**ONE, "data": 8}, DEVICES["h100"], with_compiled=False)
    assert not p["fits"]
    advice = " ".join(p["advice"])
    assert "fsdp=4 or more" in advice  # 16 B x 8B params in 60% of 80 GiB needs 4-way sharding
    assert "model.remat=full" in advice


def test_cli_plan_exit_codes_and_one_line_errors(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "marin-8b", "--mesh", "data=8", "--analytic-only", "--json", str(out)]) == 6
    assert "verdict: does NOT fit" in capsys.readouterr().out
    assert json.loads(out.read_text())["fits"] is False
    assert main(["plan", "tiny", "--mesh", "data=1", "--device", "cpu", "--analytic-only"]) == 0
    assert "verdict: fits" in capsys.readouterr().out
    assert main(["plan", "tiny", "--mesh", "data=3", "--analytic-only"]) == 2
    err = capsys.readouterr().err
    assert "global_batch_size: 8 does not split" in err and len(err.strip().splitlines()) == 1
    for bad in ("data=two", "gpu=4", "fsdp=0"):
        with pytest.raises(ConfigError, match="--mesh"):
            parse_mesh(bad)
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141 GB") == 141e9
    with pytest.raises(ConfigError, match="--device-memory"):
        parse_bytes("lots")


def test_an_on_the_fly_dpo_reference_is_counted_and_a_cached_one_is_not():
    pairs = ["data.preference={train: pairs.jsonl}", "data.seq_len=4096", "train.global_batch_size=8"]
    sizes, device = parse_mesh("fsdp=8"), DEVICES["h100"]

    def bytes_of(reference: str) -> dict:
        cfg = load_config("llama3-8b", [*pairs, f"train.preference={{loss: dpo, reference: {reference}}}"])
        return plan(cfg, sizes, device, with_compiled=False)["bytes"]

    cached, on_the_fly = bytes_of("cached"), bytes_of("on_the_fly")
    assert cached["reference"] == 0.0
    # the starting params in bf16 on each of 8 fsdp shards: half the fp32 params' bytes
    assert on_the_fly["reference"] == pytest.approx(on_the_fly["params"] / 2, rel=1e-6)
    assert on_the_fly["total"] == pytest.approx(cached["total"] + on_the_fly["reference"], rel=1e-9)


def test_marin_8b_plan_holds_no_full_logits_and_no_seq_by_seq_scores():
    """The issue's command: with chunked loss and a flash kernel the plan has neither term."""
    cfg = load_config("marin-8b", ["model.remat=full"])
    p = plan(cfg, {**ONE, "fsdp": 8}, DEVICES["h100"], with_compiled=False)
    tokens = p["microbatch_tokens_per_device"]
    assert tokens == 1024 / 8 * 4096
    # One chunk of 2048 tokens' fp32 logits and gradient, plus the head-gradient accumulator.
    assert p["logit_tokens"] == cfg.train.loss_chunk_tokens == 2048
    assert p["bytes"]["logits"] < 0.01 * tokens * 2 * 4 * cfg.model.vocab_size
    assert p["attention_impl"] == "cudnn" and p["attention_keys"] == cfg.model.attention_block
    whole = plan(
        load_config("marin-8b", ["train.loss_chunk_tokens=null"]),
        {**ONE, "fsdp": 8},
        DEVICES["h100"],
        with_compiled=False,
    )
    # the old term, 501 GiB, and the head FSDP gathers whole in bf16
    m = cfg.model
    assert whole["loss_transient"] == tokens * 2 * 4 * m.vocab_size + 2 * m.hidden_size * m.vocab_size
    assert whole["bytes"]["logits"] < whole["loss_transient"]  # less the layer backward it precedes
    reference = plan(
        load_config("marin-8b", ["model.attention_impl=reference"]),
        {**ONE, "fsdp": 8},
        DEVICES["h100"],
        with_compiled=False,
    )
    assert reference["bytes"]["activations"] > 1.5 * p["bytes"]["activations"]
    assert "2,048 tokens at once" in render(p) and "attention: cudnn" in render(p)


def test_the_loss_and_a_layer_s_backward_are_not_counted_together_under_remat():
    """The loss ends before the first layer's backward starts: under remat the peak holds the larger
    of the two, plus the head's gradient accumulator; without remat every layer's intermediates are
    alive while the loss runs, so its transients add."""
    mesh = {**ONE, "fsdp": 64}

    def bytes_of(*overrides):
        return plan(load_config("marin-8b", list(overrides)), mesh, DEVICES["h100"], with_compiled=False)

    full = [bytes_of("model.remat=full", f"train.loss_chunk_tokens={n}") for n in (1024, 2048)]
    # a chunk's logits are smaller than a layer's backward either way: the total does not move
    assert full[0]["loss_transient"] < full[1]["loss_transient"]
    assert full[0]["bytes"]["total"] == full[1]["bytes"]["total"]
    accumulator = 4 * 4096 * 128256  # the fp32 gradient of the gathered head
    assert full[1]["bytes"]["logits"] == accumulator
    none = [bytes_of("model.remat=none", f"train.loss_chunk_tokens={n}") for n in (1024, 2048)]
    grew = none[1]["bytes"]["total"] - none[0]["bytes"]["total"]
    assert grew == pytest.approx(none[1]["loss_transient"] - none[0]["loss_transient"])
    # the whole microbatch's logits at once (126 GiB) are far more than a layer's backward: the excess counts
    whole = bytes_of("model.remat=full", "train.loss_chunk_tokens=null")
    assert (
        full[1]["bytes"]["total"]
        < whole["bytes"]["total"]
        < full[1]["bytes"]["total"] + whole["loss_transient"]
    )


def test_pipeline_context_and_offload_terms():
    base = ["train.microbatches=1", "train.global_batch_size=64", "model.remat=full"]
    cfg = load_config("marin-8b", base)
    flat = plan(cfg, {**ONE, "fsdp": 8}, DEVICES["h100"], with_compiled=False)
    piped_cfg = load_config("marin-8b", [*base, "train.pipeline={microbatches: 8, repeats: 2}"])
    piped = plan(piped_cfg, {**ONE, "fsdp": 8, "pipeline": 4}, DEVICES["h100"], with_compiled=False)
    # Each stage holds a quarter of the layers' params (embedding and head are not staged).
    assert piped["bytes"]["params"] < 0.4 * flat["bytes"]["params"]
    assert piped["stage_layers"] == 8 and piped["pipeline"]["bubble"] == pytest.approx(3 / (8 * 2 + 3))
    # Same tokens per device through a quarter of the layers (each layer's input kept, remat full),
    # and one layer's intermediates for one pipeline microbatch (an eighth of the tokens) at a time.
    kept = piped["microbatch_tokens_per_device"] * 8 * 2 * cfg.model.hidden_size
    assert kept < piped["bytes"]["activations"] < flat["bytes"]["activations"] / 4
    busy = 1 - piped["pipeline"]["bubble"]
    assert piped["step_seconds"] == pytest.approx(flat["step_seconds"] / 4 / busy)
    assert "bubble 15.8%" in render(piped) and "8 layers per pipeline stage" in render(piped)
    ctx = plan(cfg, {**ONE, "fsdp": 4, "context": 2}, DEVICES["h100"], with_compiled=False)
    assert (
        ctx["microbatch_tokens_per_device"] == flat["microbatch_tokens_per_device"]
    )  # 2x the rows, half the seq
    assert "a ring over context=2" in render(ctx)
    off = plan(
        load_config("marin-8b", [*base, "train.offload.optimizer=true"]),
        {**ONE, "fsdp": 8},
        DEVICES["h100"],
        with_compiled=False,
    )
    b = off["bytes"]
    assert b["offloaded"] == flat["bytes"]["optimizer"] and 0 < b["offload_streamed"] < b["offloaded"] / 2
    assert b["total"] == pytest.approx(flat["bytes"]["total"] - b["offloaded"] + b["offload_streamed"])
    assert "held in host memory (train.offload)" in render(off)


def test_cli_compare_prints_the_layouts_side_by_side(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "moe-535b-a23b", "--device", "h200", "--analytic-only", "--json", str(out),
                 "--compare", "fsdp=32,expert=8 train.pipeline=null train.microbatches=16"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "pipeline=3 x fsdp=64 x expert=8" in text and "fsdp=32 x expert=8" in text
    data = json.loads(out.read_text())
    other = data["compare"]["fsdp=32,expert=8 train.pipeline=null train.microbatches=16"]
    assert data["devices"] == 1536 and other["devices"] == 256 and other["pipeline"] is None
    assert data["step_seconds"] < other["step_seconds"] / 4


@pytest.mark.slow
def test_the_gpu_check_rehearses_on_cpu(tmp_path):
    """bench/accelerator.py's --smoke shape runs end to end here (a GPU session runs the real shapes)."""
    import subprocess
    import sys

    out = tmp_path / "acc.json"
    cmd = [
        sys.executable,
        "bench/accelerator.py",
        "--smoke",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    r = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert "error" not in row, row
    assert row["tokens_per_second"] > 0 and 0 < row["mfu"] < 1
    assert row["peak_bytes_compiled"] > row["peak_bytes_analytic"] > 0
    assert len(row["losses"]) == 2 and all(x == x for x in row["losses"])
    assert "is not a known target" in row["predicted_error"]  # a CPU has no compile-only target
