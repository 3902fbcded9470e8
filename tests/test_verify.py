"""Every checkpoint read and every token-shard read is verified (issue 22, items 5 and 6).

One tiny run is trained once (module fixture: checkpoints 2, 4 and 6, each with its sha256 sidecar);
each test copies what it breaks. The CLI runs in-process (`shipyard.cli.main.main`). The per-user
hash cache (data/hashcache.py) is pointed at a temporary XDG_CACHE_HOME for the whole module.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from shipyard.cli.main import main
from shipyard.data import hashcache
from shipyard.errors import DataError, RunDirError

RUNDIR, DATA = 4, 3  # exit codes (shipyard.errors)
QUIET = ["train.logging.progress=false", "train.logging.log_every=1"]
SETTLE_NS = 100_000_000  # hashcache.RACY_NS for the cache tests (2 s by default), so they wait 0.2 s


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("xdg-cache")
        mp.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def world(tmp_path_factory, cache):
    """Token shards (2 shards, BPE tokenizer) and a 6-step run on them saving at 2, 4 and 6."""
    from hf_fixtures import tokenized_shards

    root = tmp_path_factory.mktemp("verify")
    tokenized_shards(root, documents=150, shard_tokens=1500)
    argv = _train_argv(root / "run", root / "shards", "train.steps=6", "train.checkpoint.every=2")
    assert main(argv) == 0
    return root


def _train_argv(run_dir: Path, shards: Path, *extra: str) -> list[str]:
    return [
        "train",
        "tiny",
        f"data.train_tokens={shards}",
        "model.vocab_size=320",
        "data.seq_len=32",
        *QUIET,
        *extra,
        "--run-dir",
        str(run_dir),
    ]


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def _biggest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _run_copy(world: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    return run


def _one_line(capsys, code: int, expected: int) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected, f"exit {code}, expected {expected}; stderr: {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one line: {err!r}"
    assert "Traceback" not in out + err
    return lines[0]


# -- item 5: checkpoints --------------------------------------------------------------------------


def test_the_fixture_run_has_verified_checkpoints_and_says_so(world):
    ckpts = world / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.sha256.json")) == [
        "2.sha256.json",
        "4.sha256.json",
        "6.sha256.json",
    ]
    inputs = json.loads((world / "run" / "provenance.json").read_text())["inputs"]
    assert inputs["train_tokens"]["verified"] is True


def test_a_flipped_byte_in_the_newest_checkpoint_is_refused_by_every_reader(world, tmp_path, capsys):
    from shipyard.experiment.steps import digest

    run = _run_copy(world, tmp_path)
    victim = _biggest_file(run / "checkpoints" / "6")
    _flip(victim)
    capsys.readouterr()
    readers = {
        "export hf": ["export", "hf", str(run), str(tmp_path / "hf")],
        "generate": ["generate", str(run), "--prompt", "the model", "--max-new-tokens", "2"],
        "eval": ["eval", str(run), "--tokens", f"held={world / 'shards'}", "--out", str(tmp_path / "e.json")],
        "train.init_from": _train_argv(
            tmp_path / "ft", world / "shards", "train.steps=1", f"train.init_from={run}"
        ),
        "serve": ["serve", str(run), "--port", "0"],
        "chat": ["chat", str(run)],
    }
    for what, argv in readers.items():
        line = _one_line(capsys, main(argv), RUNDIR)
        assert line.startswith(f"error: {what}: checkpoint 6 of "), line
        assert str(victim) in line and "does not match its recorded sha256" in line, line
        assert "checkpoint 4 verifies" in line, line
    assert "pass --step 4" in _one_line(capsys, main(readers["export hf"]), RUNDIR)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "e.json").exists()
    assert not (tmp_path / "ft").exists(), "train.init_from was refused after the run directory was written"
    with pytest.raises(RunDirError, match=r"digest: checkpoint 6 of .* does not match"):
        digest("train", run)


def test_a_flipped_byte_in_any_file_of_a_checkpoint_is_detected_on_read(world, tmp_path):
    """Every kind of file a checkpoint has (Orbax's metadata, commit markers, the OCDBT manifests and
    data files, the array metadata, the sidecar itself) flipped in turn: what every reader checks
    (`verify_checksums`) names it, and resume falls back to checkpoint 4."""
    from shipyard.run.checkpoint import restore_latest, verify_checksums

    source = world / "run" / "checkpoints"
    names = sorted(p.relative_to(source / "6").as_posix() for p in (source / "6").rglob("*") if p.is_file())
    kinds = {n.split("/")[-1] if "/d/" not in n else n.rsplit("/", 1)[0] + "/*" for n in names}
    assert {"_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA", "manifest.ocdbt", "process_0"} <= kinds
    for i, name in enumerate([*names, "../6.sha256.json"]):
        directory = tmp_path / str(i)
        shutil.copytree(source, directory)
        victim = directory / "6" / name
        if victim.stat().st_size:
            _flip(victim)
        else:
            victim.write_bytes(b"\0")  # an empty file gains a byte
        problem = verify_checksums(directory, 6)
        assert problem is not None, f"a flipped byte in {name} went unnoticed"
        if not name.startswith(".."):  # (a flipped sidecar names a file that is not there, or a hash)
            assert str(victim) in problem and "does not match its recorded sha256" in problem, problem
        said = []
        step, _ = restore_latest(directory, None, say=said.append)
        assert step == 4 and "checkpoint 6" in said[0] and "falling back to checkpoint 4" in said[0], said


def test_step_of_an_older_good_checkpoint_still_works(world, tmp_path, capsys):
    run = _run_copy(world, tmp_path)
    _flip(_biggest_file(run / "checkpoints" / "6"))
    assert main(["export", "hf", str(run), str(tmp_path / "hf"), "--step", "4"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the model", "--max-new-tokens", "2", "--step", "2"]) == 0
    # the bad one stays refused when asked for by name
    line = _one_line(capsys, main(["generate", str(run), "--prompt", "a", "--step", "6"]), RUNDIR)
    assert "checkpoint 6" in line and "pass --step 4" in line


def test_all_checkpoints_unusable(world, tmp_path, capsys):
    run = _run_copy(world, tmp_path)
    for step in (2, 4, 6):
        _flip(_biggest_file(run / "checkpoints" / str(step)))
    line = _one_line(capsys, main(["export", "hf", str(run), str(tmp_path / "hf")]), RUNDIR)
    assert "checkpoint 6" in line and "no other checkpoint verifies either (4, 2)" in line, line
    assert not (tmp_path / "hf").exists()


def test_an_unreadable_sidecar_is_refused(world, tmp_path, capsys):
    run = _run_copy(world, tmp_path)
    (run / "checkpoints" / "6.sha256.json").write_text('{"default/": ')
    line = _one_line(capsys, main(["export", "hf", str(run), str(tmp_path / "hf")]), RUNDIR)
    assert "6.sha256.json is unreadable" in line and "pass --step 4" in line, line
    (run / "checkpoints" / "6.sha256.json").write_text("[1, 2]")  # valid JSON, not {file: sha256}
    line = _one_line(capsys, main(["export", "hf", str(run), str(tmp_path / "hf")]), RUNDIR)
    assert "6.sha256.json is not a {file: sha256} object" in line, line
    assert not (tmp_path / "hf").exists()


def test_a_file_the_sidecar_lists_that_is_missing_is_refused(world, tmp_path, capsys):
    run = _run_copy(world, tmp_path)
    victim = _biggest_file(run / "checkpoints" / "6")
    victim.unlink()
    line = _one_line(capsys, main(["export", "hf", str(run), str(tmp_path / "hf")]), RUNDIR)
    assert f"file {victim} is missing" in line and "pass --step 4" in line, line


def test_a_checkpoint_without_a_sidecar_yet_is_read_as_resume_reads_it(world, tmp_path, capsys):
    """The sidecar is written after Orbax has finalised the save; a run killed in between leaves a
    complete checkpoint without one, which --resume accepts, and so does every other reader."""
    run = _run_copy(world, tmp_path)
    (run / "checkpoints" / "6.sha256.json").unlink()
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    # ...but a checkpoint without a sidecar that does not load is still one line, not a traceback
    for f in (run / "checkpoints" / "6").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0" * f.stat().st_size)
    line = _one_line(capsys, main(["export", "hf", str(run), str(tmp_path / "hf2")]), RUNDIR)
    assert "checkpoint 6" in line and "does not load" in line and "pass --step 4" in line, line


def test_checkpoint_hashes_are_cached_but_a_rewritten_file_is_rehashed(world, tmp_path, monkeypatch):
    from shipyard.run.model_dir import open_model_dir

    monkeypatch.setattr(hashcache, "RACY_NS", SETTLE_NS)
    run = _run_copy(world, tmp_path)
    time.sleep(2 * SETTLE_NS / 1e9)  # files changed just before hashing are not remembered
    model_dir = open_model_dir(run, "export hf")
    model_dir.verify(6)  # first read of this copy: hashed
    calls = []
    real = hashcache.file_sha256
    monkeypatch.setattr(hashcache, "file_sha256", lambda p: calls.append(p) or real(p))
    model_dir.verify(6)
    assert calls == []
    victim = _biggest_file(run / "checkpoints" / "6")
    before = victim.stat()
    _flip(victim)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime: ctime changed
    with pytest.raises(RunDirError, match="does not match its recorded sha256"):
        model_dir.verify(6)
    assert calls and Path(calls[0]) == victim


# -- item 6: token shards -------------------------------------------------------------------------


def _shards_copy(world: Path, tmp_path: Path) -> Path:
    shards = tmp_path / "shards"
    shutil.copytree(world / "shards", shards)
    return shards


def _shard(shards: Path, k: int = 1) -> Path:
    return shards / json.loads((shards / "manifest.json").read_text())["shards"][k]["file"]


def test_a_flipped_byte_in_a_shard_is_refused_before_training(world, tmp_path, capsys):
    shards = _shards_copy(world, tmp_path)
    _flip(_shard(shards))
    line = _one_line(capsys, main(_train_argv(tmp_path / "r", shards, "train.steps=1")), DATA)
    assert f"{_shard(shards).name} is corrupt" in line and str(shards) in line, line
    assert not (tmp_path / "r").exists(), "a refused run left a run directory"


def test_a_truncated_shard_is_refused_even_without_verify(world, tmp_path, capsys):
    shards = _shards_copy(world, tmp_path)
    path = _shard(shards)
    path.write_bytes(path.read_bytes()[:-6])  # whole tokens gone: numpy's header still parses
    for verify in ("true", "false"):
        argv = _train_argv(tmp_path / "r", shards, "train.steps=1", f"data.verify={verify}")
        line = _one_line(capsys, main(argv), DATA)
        assert f"{path.name} is " in line and "truncated or appended to" in line, line
    assert not (tmp_path / "r").exists()


def test_verify_false_trains_on_unverified_shards_and_provenance_says_so(world, tmp_path):
    shards = _shards_copy(world, tmp_path)
    _flip(_shard(shards), at=-3)  # a token id changes, the size does not: only a hash can tell
    argv = _train_argv(tmp_path / "r", shards, "train.steps=1", "data.verify=false")
    assert main(argv) == 0
    inputs = json.loads((tmp_path / "r" / "provenance.json").read_text())["inputs"]
    assert inputs["train_tokens"]["verified"] is False
    assert "verify: false" in (tmp_path / "r" / "config.yaml").read_text()


def test_a_second_start_uses_the_cache_and_a_changed_shard_is_rehashed(world, tmp_path, monkeypatch):
    from shipyard.data.loader import build_loader

    monkeypatch.setattr(hashcache, "RACY_NS", SETTLE_NS)
    shards = _shards_copy(world, tmp_path)
    n = len(json.loads((shards / "manifest.json").read_text())["shards"])
    assert n >= 2
    calls = []
    real = hashcache.file_sha256
    monkeypatch.setattr(hashcache, "file_sha256", lambda p: calls.append(Path(p).name) or real(p))

    def start():
        calls.clear()
        return build_loader([str(shards)], [1.0], 0, 8, 32, 320)

    time.sleep(2 * SETTLE_NS / 1e9)
    start()
    assert len(calls) == n  # first start: every shard hashed once
    start()
    assert calls == []  # second start: all from the cache
    victim = _shard(shards)
    before = victim.stat()
    _flip(victim, at=-3)  # same size, and the mtime set back: only the ctime tells
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (victim.stat().st_size, victim.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(DataError, match=f"{victim.name} is corrupt"):
        start()
    assert calls == [victim.name]  # only the changed shard was hashed again
    _flip(victim, at=-3)  # the bytes restored: good again
    start()
    start()  # changed too recently to be remembered (a same-tick rewrite could keep its stat)
    assert calls == [victim.name]
    time.sleep(2 * SETTLE_NS / 1e9)
    start()
    start()
    assert calls == []  # settled, hashed once more and remembered
    _flip(victim, at=-3)  # a plain rewrite
    with pytest.raises(DataError, match=f"{victim.name} is corrupt"):
        start()
    # `data verify` hashes afresh whatever the cache says
    _flip(victim, at=-3)  # restored
    time.sleep(2 * SETTLE_NS / 1e9)
    start()
    calls.clear()
    from shipyard.data.shards import verify_shards

    verify_shards(shards)
    assert len(calls) == n


def test_held_out_shards_are_verified_too(world, tmp_path, capsys):
    """`shipyard eval --tokens` (and the in-loop evaluation's data.validation_tokens) read shards
    through the same open_shards."""
    shards = _shards_copy(world, tmp_path)
    _flip(_shard(shards, 0))
    argv = ["eval", str(world / "run"), "--tokens", f"held={shards}", "--out", str(tmp_path / "e.json")]
    line = _one_line(capsys, main(argv), DATA)
    assert f"{_shard(shards, 0).name} is corrupt" in line
    argv = _train_argv(tmp_path / "r", world / "shards", "train.steps=1", "train.eval_every=1")
    line = _one_line(capsys, main([*argv, f"data.validation_tokens={shards}"]), DATA)
    assert "is corrupt" in line and not (tmp_path / "r").exists()


def test_an_unwritable_cache_only_costs_rehashing(world, tmp_path, monkeypatch):
    from shipyard.data.shards import open_shards

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # a file where the cache directory would go
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    manifest, arrays = open_shards(world / "shards")
    assert len(arrays) == len(manifest["shards"])
    assert np.concatenate(arrays).size == sum(s["tokens"] for s in manifest["shards"])
