"""`shipyard train` with preference pairs (DPO / SimPO / ORPO): reference log-probs cached or on the fly,
microbatches, the start-up summary and run header, resume with the reference cache, LoRA, and the
end-to-end learning tests (a word-writing model learns to prefer uppercase, with DPO and with ORPO)."""

import json
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from chat_fixtures import QUIET, write_chats, write_tokenizer
from kill_fixtures import final_params, logged_rows, start_train, wait_until

from shipyard.cli.main import main
from shipyard.data.shards import file_sha256

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

LN2 = float(np.log(2.0))
PAIR_METRICS = (
    "pref_accuracy",
    "reward_margin",
    "chosen_logps",
    "rejected_logps",
    "chosen_reward",
    "rejected_reward",
)


def _words(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5))) for _ in range(n)
    ]


def _pairs(words: list[str]) -> list[dict]:
    """The task: asked to write a word, the uppercase form is preferred over the lowercase one."""
    return [{"prompt": f"write a word: {w}", "chosen": w.upper(), "rejected": w} for w in words]


def _write_pairs(path: Path, pairs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def _run(run_dir: Path, *args: str, devices: int = 1) -> str:
    """`shipyard train ARGS` in a child process on one CPU device (the fastest here); its output."""
    proc = start_train(run_dir, list(args), devices)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


def _losses(run_dir: Path) -> list[float]:
    rows = logged_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small pair set (with one bad pair of each kind) and held-out pairs, and the tokenizer."""
    d = tmp_path_factory.mktemp("pairs")
    bad = [
        {"prompt": "write a word: x", "chosen": " ", "rejected": "x"},  # empty_reply
        {"prompt": "write a word: y", "chosen": "y", "rejected": "y"},  # identical
        {"prompt": "write a word: " + "z" * 80, "chosen": "Z" * 80, "rejected": "z" * 80},  # too_long
    ]
    train = _write_pairs(d / "train.jsonl", _pairs(_words(0, 40)) + bad)
    held = _write_pairs(d / "held.jsonl", _pairs(_words(1, 16)))
    return {"train": train, "held": held, "tok": write_tokenizer(d / "tok")}


def _dpo_args(small, *extra: str) -> list[str]:
    data = (
        f"data.preference={{train: {small['train']}, validation: {small['held']}, tokenizer: {small['tok']}}}"
    )
    return [
        "tiny",
        "data.seq_len=64",
        data,
        "train.steps=4",
        "train.eval_every=2",
        "train.eval_batches=2",
        "train.logging.log_every=1",
        "train.checkpoint.every=2",
        "train.optimizer.lr=3e-3",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def cached(tmp_path_factory, small):
    """A 4-step DPO run with cached reference log-probs (full training from the seeded init)."""
    run = tmp_path_factory.mktemp("cached") / "run"
    out = _run(run, *_dpo_args(small, "train.preference={loss: dpo, beta: 0.5}"))
    return run, out


def test_dpo_run_logs_pair_metrics_and_records_its_inputs(cached, small):
    """The start-up summary counts the bad pairs by reason; the run header hashes the pair files and
    tokenizer; the tokenizer travels with the run; metrics.jsonl has the pair metrics next to
    grad_norm and the held-out ones; the policy starts equal to the reference (loss ln 2, zero
    rewards) and the loss falls; the reference cache is written with its manifest."""
    run, out = cached
    assert "bad pairs left out: 1 empty_reply, 1 identical, 1 too_long" in out, out
    assert "shipyard: preference data: 40 pairs" in out and "16 held-out pairs" in out, out
    inputs = json.loads((run / "provenance.json").read_text())["inputs"]
    assert inputs["preference_train"]["sha256"] == file_sha256(small["train"])
    assert inputs["preference_validation"]["sha256"] == file_sha256(small["held"])
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (
        small["tok"] / "tokenizer.json"
    ).read_bytes()
    rows = logged_rows(run)
    first, last = rows[0], rows[-1]
    assert abs(first["loss"] - LN2) < 1e-6 and first["reward_margin"] == 0.0 and first["chosen_reward"] == 0.0
    assert all(k in first for k in (*PAIR_METRICS, "grad_norm", "update_norm", "lr"))
    assert "z_loss" not in first and "entropy" not in first
    assert last["loss"] < first["loss"] - 1e-3 and last["reward_margin"] > 0
    held = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(held) == [1, 3]
    assert all(f"val_{k}" in held[3] for k in PAIR_METRICS) and held[3]["val_loss"] < LN2
    manifest = json.loads((run / "reference_logps" / "manifest.json").read_text())
    for split, rows_n in (("train", 40), ("validation", 16)):
        a = np.load(run / "reference_logps" / f"{split}.npy")
        assert a.shape[0] == rows_n and a.dtype == np.float32  # one pair per row at seq_len 64
        assert manifest["files"][split]["sha256"] == file_sha256(run / "reference_logps" / f"{split}.npy")
    assert manifest["fingerprint"]["inputs"]["preference_train"] == file_sha256(small["train"])


def test_on_the_fly_reference_and_microbatches_give_the_cached_loss_curve(cached, small, tmp_path):
    """The reference forward in every step (on_the_fly), with the batch in two microbatches, gives
    the loss curve of the cached reference in one batch (train and held-out, within 1e-5)."""
    run = tmp_path / "otf"
    out = _run(
        run,
        *_dpo_args(
            small, "train.preference={loss: dpo, beta: 0.5, reference: on_the_fly}", "train.microbatches=2"
        ),
    )
    assert not (run / "reference_logps").exists() and "reference log-probs" not in out
    a, b = _losses(cached[0]), _losses(run)
    assert _close(a, b), (a, b)
    norms = [[r["grad_norm"] for r in logged_rows(r_)] for r_ in (cached[0], run)]
    assert _close(*norms), norms  # the microbatches' gradients add up to the batch's (not twice it)
    val = [[r["val_loss"] for r in logged_rows(r_) if "val_loss" in r] for r_ in (cached[0], run)]
    assert _close(*val), val


@pytest.mark.slow
def test_resume_reuses_the_reference_cache_and_recomputes_a_stale_one(cached, small, tmp_path, capsys):
    """--resume reuses the cached log-probs untouched (one line says so); a cache whose file no longer
    matches its sha256 is recomputed from the rebuilt starting model, to the same bytes."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cached[0], run)
    cache = run / "reference_logps"
    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    before = (cache / "train.npy").read_bytes()
    out = _run(run, *_dpo_args(small, "train.preference={loss: dpo, beta: 0.5}", "train.steps=6"), "--resume")
    assert "resumed from checkpoint 4" in out and f"reusing the reference log-probs in {cache}" in out, out
    assert "computed with the starting model" not in out
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp
    assert [r["step"] for r in logged_rows(run)] == list(range(6))
    broken = bytearray(before)
    broken[-1] ^= 0xFF
    (cache / "train.npy").write_bytes(bytes(broken))
    out = _run(run, *_dpo_args(small, "train.preference={loss: dpo, beta: 0.5}", "train.steps=7"), "--resume")
    assert "recomputing the reference log-probs" in out and "train.npy is missing or does not match" in out, (
        out
    )
    assert (cache / "train.npy").read_bytes() == before
    # rows packed otherwise would not continue the run: refused, nothing touched
    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    args = _dpo_args(small, "train.preference={loss: dpo, beta: 0.5}", "train.steps=8")
    args[2] = args[2].replace("}", ", pack: false}")
    assert main(["train", *args, "--run-dir", str(run), "--resume"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.preference.pack: True, this config has False" in err, err
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp


def test_document_masking_with_pairs_is_refused(small, tmp_path, capsys):
    """Preference pairs carry their own segment ids: data.document_masking is refused with one line,
    nothing written."""
    refused = tmp_path / "refused"
    argv = [
        "train",
        *_dpo_args(small, "train.preference={loss: dpo}", "data.document_masking=true", "data.eos_id=1"),
    ]
    assert main([*argv, "--run-dir", str(refused)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.document_masking: preference pairs" in err, err
    assert not refused.exists()


@pytest.mark.slow
def test_simpo_needs_no_reference(small, tmp_path):
    """SimPO ignores the reference settings (nothing cached, no reference forward) and trains."""
    run = tmp_path / "simpo"
    out = _run(
        run, *_dpo_args(small, "train.preference={loss: simpo, beta: 2.0, gamma: 0.5, reference: cached}")
    )
    assert not (run / "reference_logps").exists() and "reference log-probs" not in out
    losses = _losses(run)
    assert abs(losses[0] - LN2) > 1e-3 and losses[-1] < losses[0]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The learning task's files and a tiny model SFT-trained on it a little: asked to write a word,
    it writes it in uppercase or lowercase at random (half of each in its data), so it starts with no
    preference between the two forms."""
    d = tmp_path_factory.mktemp("task")
    tok = write_tokenizer(d / "tok")
    words = _words(0, 2000)
    seen = set(words)
    held = [w for w in _words(1, 400) if w not in seen][:96]
    rng = random.Random(2)
    sft = [
        {"messages": [{"role": "user", "content": f"write a word: {w}"}, {"role": "assistant", "content": c}]}
        for w in words
        for c in [w.upper() if rng.random() < 0.5 else w]
    ]
    files = {
        "tok": tok,
        "sft": write_chats(d / "sft.jsonl", sft),
        "pairs": _write_pairs(d / "pairs.jsonl", _pairs(words)),
        "held": _write_pairs(d / "held.jsonl", _pairs(held)),
    }
    sft_run = d / "sft"
    chat = f"data.chat={{train: {files['sft']}, tokenizer: {tok}}}"
    _run(sft_run, "tiny", "data.seq_len=64", chat, "train.steps=1500", "train.optimizer.lr=5e-3", *QUIET)
    return {**files, "sft_run": sft_run}


def _task_args(task, *extra: str) -> list[str]:
    data = (
        f"data.preference={{train: {task['pairs']}, validation: {task['held']}}}"  # tokenizer: the SFT run's
    )
    return [
        "tiny",
        "data.seq_len=64",
        f"train.init_from={task['sft_run']}",
        data,
        "train.preference={loss: dpo, beta: 0.5}",
        "train.steps=60",
        "train.optimizer.lr=3e-4",
        "train.eval_every=30",
        "train.eval_batches=12",  # the 96 held-out pairs, one per row
        "train.logging.log_every=1",
        "train.checkpoint.every=20",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def dpo_run(task, tmp_path_factory):
    run = tmp_path_factory.mktemp("dpo") / "run"
    _run(run, *_task_args(task))
    return run


def _greedy(run: Path, pairs_file: Path) -> dict:
    """Greedy replies of the run's model to the held-out prompts: the fraction in uppercase form, and
    the fraction that is exactly the preferred reply."""
    from shipyard.inference.chat import load_chat_model

    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    model = load_chat_model(run)
    got = [
        model.decode(o).strip()
        for o in model.replies([[{"role": "user", "content": p["prompt"]}] for p in pairs], 12)
    ]
    return {
        "upper": float(np.mean([g.isalpha() and g.isupper() for g in got])),
        "exact": float(np.mean([g == p["chosen"] for g, p in zip(got, pairs)])),
        "replies": got[:6],
    }


@pytest.mark.slow
def test_dpo_learns_the_preferred_form(task, dpo_run, tmp_path):
    """From a model with no preference between the forms (held-out accuracy of its own log-probs
    about 0.5, greedy replies about half uppercase), 60 DPO steps reach held-out reward accuracy
    >= 0.9 (DPO's metric: relative to the starting model), the trained model's own log-probs prefer
    the chosen reply on >= 0.8 of the held-out pairs and >= 0.2 more than before (the starting
    model's metric, measured again), and its greedy replies switch to the preferred uppercase form.
    The margins hold across CPUs: the exact trajectory depends on the host's XLA code (0.58 -> 0.96
    on one 2-core VM, 0.57 -> 0.85 on another)."""
    ref = np.load(dpo_run / "reference_logps" / "validation.npy")
    start_accuracy = float(np.mean(ref[:, 0] > ref[:, 1]))  # the starting model prefers chosen (slot 0)
    assert ref.shape[0] == 96 and 0.3 <= start_accuracy <= 0.7, start_accuracy
    held = [r for r in logged_rows(dpo_run) if "val_pref_accuracy" in r]
    assert [r["step"] for r in held] == [29, 59]
    assert held[-1]["val_pref_accuracy"] >= 0.9 and held[-1]["val_loss"] < held[0]["val_loss"] < LN2, held
    # the trained model's own preference: the reference log-probs a run starting from it computes
    own = tmp_path / "own"
    _run(own, *_task_args(task, f"train.init_from={dpo_run}", "train.steps=1", "train.eval_every=1000"))
    mine = np.load(own / "reference_logps" / "validation.npy")
    own_accuracy = float(np.mean(mine[:, 0] > mine[:, 1]))
    before, after = _greedy(task["sft_run"], task["held"]), _greedy(dpo_run, task["held"])
    print(
        f"own preference {start_accuracy:.2f} -> {own_accuracy:.2f}, reward accuracy "
        f"{held[-1]['val_pref_accuracy']:.2f}; {before} -> {after}"
    )
    assert own_accuracy >= max(0.8, start_accuracy + 0.2), (start_accuracy, own_accuracy)
    assert 0.2 <= before["upper"] <= 0.8 and after["upper"] >= 0.9, (before, after)
    assert after["exact"] > before["exact"], (before, after)


@pytest.mark.slow
def test_orpo_learns_the_preferred_form_without_a_reference(task, tmp_path):
    """ORPO from the same starting model: no reference is cached or run; its reward is beta times the
    mean token log-prob, so its held-out accuracy is the model's own preference, which reaches >= 0.8
    (0.85 to 0.96 on the CPUs seen; the SFT model starts near 0.57); the held-out loss falls and the greedy replies switch to the preferred uppercase form."""
    run = tmp_path / "orpo"
    out = _run(run, *_task_args(task, "train.preference={loss: orpo, beta: 0.5}"))
    assert not (run / "reference_logps").exists() and "reference log-probs" not in out, out
    held = [r for r in logged_rows(run) if "val_pref_accuracy" in r]
    assert [r["step"] for r in held] == [29, 59]
    assert held[-1]["val_pref_accuracy"] >= 0.8 and held[-1]["val_loss"] < held[0]["val_loss"], held
    before, after = _greedy(task["sft_run"], task["held"]), _greedy(run, task["held"])
    print(f"orpo: reward accuracy {held[-1]['val_pref_accuracy']:.2f}; {before} -> {after}")
    assert 0.2 <= before["upper"] <= 0.8 and after["upper"] >= 0.9, (before, after)


@pytest.mark.slow
def test_dpo_killed_and_resumed_is_bitwise_equal(task, dpo_run, tmp_path):
    """SIGKILL after the first checkpoint, then --resume: every step's loss and the final params equal
    the straight run bitwise, and the reference log-probs are reused from the run directory, not
    recomputed."""
    run = tmp_path / "run"
    proc = start_train(run, _task_args(task))
    wait_until(proc, lambda: (run / "checkpoints" / "20").is_dir())
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert max(r["step"] for r in logged_rows(run)) < 59, "killed too late to test resume"
    cache = run / "reference_logps"
    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    time.sleep(0.01)
    out = _run(run, *_task_args(task), "--resume")
    assert "resumed from checkpoint" in out and "reusing the reference log-probs" in out, out
    assert "computed with the starting model" not in out, out
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp
    assert _losses(run) == _losses(dpo_run)  # bitwise: float equality, each step logged once
    for x, y in zip(final_params(dpo_run, 60), final_params(run, 60)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_lora_and_qlora_dpo_learn_and_on_the_fly_matches_cached(task, tmp_path):
    """LoRA DPO on the SFT model: starts at loss ln 2 (fresh adapters leave the model its own
    reference), reaches held-out preference accuracy >= 0.9; the on-the-fly reference gives the
    same loss curve (within 1e-5); the checkpoint holds the adapters alone. QLoRA (an nf4 base)
    learns too, against the quantized starting model as its reference."""
    lora = ["train.optimizer.lr=3e-3", "train.steps=40", "train.eval_every=40"]
    runs = {name: tmp_path / name for name in ("lora", "otf", "qlora")}
    _run(runs["lora"], *_task_args(task, "train.finetune={lora: {rank: 8}}", *lora))
    otf = "train.preference={loss: dpo, beta: 0.5, reference: on_the_fly}"
    _run(runs["otf"], *_task_args(task, "train.finetune={lora: {rank: 8}}", *lora, otf))
    _run(runs["qlora"], *_task_args(task, "train.finetune={lora: {rank: 8}, quantize_base: nf4}", *lora))
    a, b, q = (_losses(runs[n]) for n in ("lora", "otf", "qlora"))
    assert abs(a[0] - LN2) < 1e-6 and abs(q[0] - LN2) < 1e-6 and _close(a, b), (a, b, q)
    for name in ("lora", "qlora"):
        held = [r for r in logged_rows(runs[name]) if "val_pref_accuracy" in r]
        assert held[-1]["val_pref_accuracy"] >= 0.9, (name, held)
    assert sum(x.size for x in final_params(runs["lora"], 40)) < 20_000  # adapters only (of 164k params)
    ref, ref_q = (np.load(runs[n] / "reference_logps" / "train.npy") for n in ("lora", "qlora"))
    gap = np.abs(ref - ref_q)[:, :2]  # one pair per row
    assert 0 < gap.mean() < 0.5 * np.abs(ref[:, :2]).mean(), gap.mean()  # the quantized base: near, not equal
