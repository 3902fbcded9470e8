import json

import numpy as np
import pytest
import yaml

from shipyard.cli.main import main


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, tokens, name, *extra):
    argv = ["train", "tiny", f"data.train_tokens={tokens}", f"run.out_dir={tmp_path}", f"run.name={name}"]
    return main([*argv, "train.logging.progress=false", *extra])


def test_short_run_writes_complete_run_dir(tmp_path, byte_tokens, capsys):
    assert _train(tmp_path, byte_tokens, "short", "train.steps=12", "train.logging.log_every=5") == 0
    run = tmp_path / "short"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["train"]["steps"] == 12 and cfg["model"]["head_dim"] == 16
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["versions"]["jax"] and prov["devices"]["count"] >= 1
    assert len(prov["inputs"]["train_tokens"]["sha256"]) == 64
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 5, 10, 11]
    for key in ("loss", "lr", "grad_norm", "param_norm", "update_norm", "entropy", "tokens_per_s", "mfu"):
        assert all(key in r for r in rows), key
    assert rows[0]["tokens_per_s"] is None  # first step is compile time, not throughput
    assert rows[-1]["tokens_per_s"] > 0 and 0 < rows[-1]["mfu"] < 1
    assert rows[-1]["nonfinite_total"] == 0


def test_refuses_to_overwrite_a_run(tmp_path, byte_tokens, capsys):
    assert _train(tmp_path, byte_tokens, "r", "train.steps=2", "train.schedule.warmup_steps=0") == 0
    before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert _train(tmp_path, byte_tokens, "r", "train.steps=2", "train.schedule.warmup_steps=0") == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0]
    assert (tmp_path / "r" / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: None, "does not exist"),
        (lambda p: np.save(p, np.zeros((4, 4), np.int32)), "expected a 1-D integer array"),
        (lambda p: np.save(p, np.full(1000, 9999, np.int32)), "outside model.vocab_size=512"),
        (lambda p: np.save(p, np.zeros(10, np.int32)), "fewer than one sequence"),
        (lambda p: p.write_bytes(b"not an npy file"), "not a readable .npy"),
    ],
)
def test_bad_token_file(tmp_path, capsys, make, needle):
    path = tmp_path / "tokens.npy"
    make(path)
    assert _train(tmp_path, path, "bad", "train.steps=2", "train.schedule.warmup_steps=0") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_missing_train_tokens_is_a_config_error(tmp_path, capsys):
    assert main(["train", "tiny", f"run.out_dir={tmp_path}"]) == 2
    assert "data.train_tokens is not set" in capsys.readouterr().err


def test_divergence_stops_with_advice(tmp_path, byte_tokens, capsys):
    code = _train(
        tmp_path,
        byte_tokens,
        "nan",
        "train.steps=40",
        "train.optimizer.lr=1e30",
        "train.schedule.kind=constant",
        "train.schedule.warmup_steps=0",
        "train.max_consecutive_nonfinite=3",
        "train.optimizer.clip_norm=null",
    )
    err = capsys.readouterr().err
    assert code == 5
    assert "consecutive steps had a non-finite loss" in err and "--debug-nans" in err
    rows = _metrics(tmp_path / "nan")
    assert rows[-1]["nonfinite_run"] == 3 and rows[-1]["step"] < 39


@pytest.mark.slow
def test_200_step_run_is_bitwise_reproducible_and_learns(tmp_path, byte_tokens):
    for name in ("a", "b"):
        assert _train(tmp_path, byte_tokens, name) == 0
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in a][-1] == 199
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    first, last = a[0]["loss"], np.mean([r["loss"] for r in a[-3:]])
    assert first > 5.5 and last < 3.2, (first, last)


def test_checkpoints_hold_the_train_state(tmp_path, byte_tokens):
    import jax

    from shipyard.config import load_config
    from shipyard.model.params import abstract_params
    from shipyard.model.transformer import param_specs
    from shipyard.run.checkpoint import restore

    extra = [
        "train.steps=12",
        "train.logging.log_every=1",
        "train.checkpoint.every=5",
        "train.checkpoint.keep=2",
    ]
    assert _train(tmp_path, byte_tokens, "ck", *extra) == 0
    ckpt_dir = tmp_path / "ck" / "checkpoints"
    assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == [
        10,
        12,
    ]  # 5 was rotated out

    cfg = load_config("tiny", [f"data.train_tokens={byte_tokens}", *extra])
    restored = restore(ckpt_dir, 12, None)
    assert int(restored["step"]) == 12
    params = restored["params"]
    expected = jax.tree.map(lambda a: a.shape, abstract_params(param_specs(cfg.model)))
    got = {k: v.shape for k, v in params["blocks"].items() if v is not None}
    assert got["wq"] == expected.blocks.wq and params["embed"].shape == expected.embed
    # the saved params are the ones whose norm was logged after the last step
    norm = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(x)))) for x in jax.tree.leaves(params))))
    assert norm == pytest.approx(_metrics(tmp_path / "ck")[-1]["param_norm"], rel=1e-5)


@pytest.mark.slow
def test_debug_nans_names_the_first_bad_operation(tmp_path, byte_tokens):
    import jax

    args = [
        "train.steps=5",
        "train.optimizer.lr=1e30",
        "train.schedule.warmup_steps=0",
        "train.optimizer.clip_norm=null",
    ]
    with pytest.raises(FloatingPointError, match=r"invalid value \((inf|nan)\) encountered"):
        _train(tmp_path, byte_tokens, "dbg", *args, "--debug-nans")
    assert not jax.config.jax_debug_nans and not jax.config.jax_debug_infs  # scoped to the run


def test_document_masking_needs_an_eos_id_for_npy_tokens(tmp_path, byte_tokens, capsys):
    args = ["train.steps=2", "train.schedule.warmup_steps=0", "data.document_masking=true"]
    assert _train(tmp_path, byte_tokens, "m", *args) == 2
    assert "set data.eos_id" in capsys.readouterr().err
    assert _train(tmp_path, byte_tokens, "m", *args, "data.eos_id=256") == 0


def test_tensorboard_events_profile_trace_and_report_plots(tmp_path, byte_tokens):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ("train.steps=12", "train.logging.log_every=2", "--profile-steps", "3:4")
    assert _train(tmp_path, byte_tokens, "tb", *extra) == 0
    run = tmp_path / "tb"
    rows = _metrics(run)
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"lr", "grad_norm", "param_norm", "entropy"} <= set(events.Tags()["scalars"])
    assert list((run / "profile").rglob("*.xplane.pb"))  # the JAX profiler trace of steps 3-4
    assert main(["report", str(run)]) == 0
    png = run / "plots" / "metrics.png"
    assert png.stat().st_size > 20_000  # six panels of curves, not an empty canvas


def test_wandb_offline_run_records_the_metrics(tmp_path, byte_tokens):
    pytest.importorskip("wandb")
    extra = (
        "train.steps=6",
        "train.logging.log_every=1",
        "train.logging.wandb={project: shipyard-test, mode: offline}",
    )
    assert _train(tmp_path, byte_tokens, "wb", *extra) == 0
    run = tmp_path / "wb"
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    # The offline log is protobuf records holding each value as JSON text: every logged loss is in it.
    raw = next(offline[0].glob("run-*.wandb")).read_bytes()
    rows = _metrics(run)
    assert len(rows) == 6 and all(json.dumps(r["loss"]).encode() in raw for r in rows)
    assert b"grad_norm" in raw and b"shipyard-test" in raw
