"""Checkpoint chaos (issue 34 item 3): a save broken at every one of its I/O boundaries.

`SHIPYARD_CHECKPOINT_FAULT` (run/fault_injection.py) first lists the boundaries of the last save
of a 6-step `tiny` run (checkpoints every 2 steps, keep 1, so that save also retires checkpoint
4, the one a kill before the new one is verified must not lose): every directory made, file
opened for writing, rename (Orbax's commits, the sidecar's), remove and rmtree, and in a run whose
directory is a bucket also each upload, each delete and the run marker. Then one run per boundary is SIGKILLed exactly there and resumed (from the bucket alone,
its working copy deleted, for the bucket case). Each must: keep the newest verified checkpoint (the
one before the save until the new one's sidecar exists, the new one after), resume from exactly
that one (never a half-written one), and end bitwise equal to a run never killed, with every
checkpoint verified and no leftovers. A disk that fills up mid-save (a real, small tmpfs filled at
a boundary, so tensorstore's own writes fail too; and an injected ENOSPC at every boundary) gives
one line and loses nothing.

The runs go two at a time (this machine's two cores), each forked from a process that imported
shipyard once (tests/forked_cli.py); the compiled step comes from the tests' shared compilation
cache, so a run is mostly its JAX backend's start-up and six steps.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import forked_cli
import numpy as np
import pytest
from kill_fixtures import final_params, logged_losses, logged_rows

from shipyard import storage
from shipyard.run import remote
from shipyard.run.checkpoint import SIDECAR, available_steps, restore_latest, verified

pytestmark = pytest.mark.slow

STEPS, EVERY, KEEP = 6, 2, 1  # keep 1: the save of 6 retires 4, the one a kill must not lose
BEFORE = STEPS - EVERY  # the newest checkpoint before the save under test
WORKERS = 2


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    from shipyard.data.bytecorpus import write_byte_tokens

    path = tmp_path_factory.mktemp("chaos-data") / "tokens.npy"
    write_byte_tokens(path, split="train", max_bytes=100_000)
    return path


def _train(run_dir, tokens: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """`shipyard train` on one host device, with the fault switch set to `fault` (stdout + stderr), as
    a forked child of a process that imported shipyard once (tests/forked_cli.py)."""
    env = {k: v for k, v in os.environ.items() if k != "SHIPYARD_CHECKPOINT_FAULT"}
    env.update(XLA_FLAGS="", SHIPYARD_NO_REEXEC="1")
    if fault is not None:
        env["SHIPYARD_CHECKPOINT_FAULT"] = fault
    argv = [
        "train",
        "tiny",
        f"data.train_tokens={tokens}",
        f"train.steps={STEPS}",
        "train.schedule.warmup_steps=2",
        f"train.checkpoint.every={EVERY}",
        f"train.checkpoint.keep={KEEP}",
        "train.logging.log_every=1",
        "train.logging.progress=false",
        *extra,
        "--run-dir",
        str(run_dir),
    ]
    return forked_cli.run(argv, env, timeout=120)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tokens) -> Path:
    run = tmp_path_factory.mktemp("chaos-straight") / "run"
    done = _train(run, tokens)
    assert done.returncode == 0, done.stdout
    return run


def _listing(where, tokens: Path, tmp: Path, *extra: str) -> list[tuple[int, str, str]]:
    """The I/O boundaries of the save of step STEPS, in order: (number, kind, target)."""
    listing = tmp / "boundaries.txt"
    done = _train(where, tokens, *extra, fault=f"from={STEPS},list={listing}")
    assert done.returncode == 0, done.stdout
    rows = _read_listing(listing)
    assert [n for n, _, _ in rows] == list(range(1, len(rows) + 1))
    return rows


def _first(listing, kind: str, suffix: str) -> int:
    return next(n for n, k, target in listing if k == kind and target.endswith(suffix))


def _in_pairs(check, cases: dict) -> None:
    """`check(case)` for each of `cases` ({what, in words: case}), WORKERS at a time; every failure
    reported, not just the first."""
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {what: pool.submit(check, case) for what, case in cases.items()}
    failures = [f"{what}: {f.exception()!r}" for what, f in futures.items() if f.exception() is not None]
    assert not failures, "\n\n".join(failures)


def _each(listing) -> dict:
    return {f"boundary {n} ({kind} {target})": n for n, kind, target in listing}


def _named(listing, n: int) -> str:
    """Boundary `n` of `listing` as the fault switch's `K,at=KIND:TARGET` (the K-th operation of that
    kind on that target), not by its number: Orbax writes its metadata from several threads, so two
    of its operations can swap places from one run to the next (CI met `open _CHECKPOINT_METADATA`
    and `mkdir default.orbax-checkpoint-tmp` in either order), while each one's name is fixed."""
    _, kind, target = listing[n - 1]
    k = sum(1 for _, k2, t in listing[:n] if k2 == kind and t.endswith(target))
    return f"{k},at={kind}:{target}"


def _killed(done: subprocess.CompletedProcess, kind: str, target: str) -> None:
    said = re.search(rf"SIGKILL at boundary \d+ \({re.escape(kind)} {re.escape(target)}\)\n", done.stdout)
    assert done.returncode == -9 and said, f"not killed where asked ({kind} {target}):\n{done.stdout}"


def _resumed(done: subprocess.CompletedProcess, step: int) -> None:
    assert done.returncode == 0, done.stdout
    assert f"resumed from checkpoint {step} " in done.stdout, done.stdout
    assert "unusable" not in done.stdout and "Traceback" not in done.stdout, done.stdout


def _same_run(rows: list[dict], params: list, straight: Path) -> None:
    """Each step logged once, in order, each loss and the final params bitwise the straight run's."""
    expected = logged_losses(straight)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["loss"] == expected[r["step"]] for r in rows)  # bitwise: float equality
    for x, y in zip(final_params(straight, STEPS), params, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_a_kill_at_every_boundary_of_a_local_save_resumes_bitwise(tmp_path, tokens, straight):
    listing = _listing(tmp_path / "listing", tokens, tmp_path)
    kinds = {kind for _, kind, _ in listing}
    # Orbax's directories, metadata writes and commit renames, the sidecar, retention's deletes
    assert {"os.mkdir", "open", "os.rename", "os.remove", "shutil.rmtree"} <= kinds, kinds
    commit = _first(listing, "os.rename", f"{STEPS}.orbax-checkpoint-tmp")
    sidecar = _first(listing, "os.rename", f"{STEPS}.sha256.tmp")
    retire = _first(listing, "os.rename", f"{BEFORE}")  # retention's first move of checkpoint 4
    assert commit < sidecar < retire  # the old one goes only once the new one is verified
    print(f"local save of step {STEPS}: {len(listing)} I/O boundaries")

    def check(n: int) -> None:
        _, kind, target = listing[n - 1]
        run = tmp_path / f"kill-{n}"
        _killed(_train(run, tokens, fault=f"from={STEPS},kill={_named(listing, n)}"), kind, target)
        directory = run / "checkpoints"
        good = [s for s in sorted(available_steps(directory)) if verified(directory, s) is None]
        expect = STEPS if n > sidecar else BEFORE
        assert good and good[-1] == expect, f"verified checkpoints after the kill: {good}"
        _resumed(_train(run, tokens, "--resume"), expect)
        # the keep policy's one, verified; no unfinished save or delete left behind
        assert sorted(p.name for p in directory.iterdir()) == [str(STEPS), f"{STEPS}{SIDECAR}"]
        assert verified(directory, STEPS) is None
        _same_run(logged_rows(run), final_params(run, STEPS), straight)

    _in_pairs(check, _each(listing))


def _read_listing(path: Path) -> list[tuple[int, str, str]]:
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(n), kind, target) for n, kind, target in rows]


def _where(kind: str, target: str, url: str) -> str:
    """A bucket boundary named without its run's URL, a checkpoint file's upload as one class (they
    go up side by side, and how many data files Orbax's OCDBT writes varies from run to run)."""
    where = target.removeprefix(url).lstrip("/")
    return f"{kind} {f'checkpoints/{STEPS}/*' if where.startswith(f'checkpoints/{STEPS}/') else where}"


def test_a_kill_at_every_boundary_of_a_save_to_a_bucket_resumes_bitwise(
    tmp_path, tokens, straight, bucket, monkeypatch
):
    """Every boundary in the bucket (uploads, deletes, the marker) killed at and resumed from the
    bucket alone. The local boundaries before them leave the bucket as the save found it, so two of
    them stand for all (the local test kills at each). The boundaries are numbered in each run's own
    listing, as their count varies (Orbax's data files); TensorBoard is off so the run files that
    go up before the checkpoint are the same each time (its event file flushes on a 10 s timer)."""
    monkeypatch.setenv("SHIPYARD_RUN_CACHE", str(tmp_path / "cache"))
    quiet = "train.logging.tensorboard=false"
    listing = _listing(f"{bucket}/runs/listing", tokens, tmp_path, quiet)
    ref = f"{bucket}/runs/listing"
    kinds = {kind for _, kind, _ in listing}
    assert {"os.mkdir", "open", "os.rename", "upload", "delete", "marker"} <= kinds, kinds
    remote_at = next(n for n, kind, _ in listing if kind in ("upload", "delete", "marker"))
    uploads = [
        n for n, kind, target in listing if _where(kind, target, ref) == f"upload checkpoints/{STEPS}/*"
    ]
    published = _first(listing, "upload", f"checkpoints/{STEPS}{SIDECAR}")
    retire = _first(listing, "delete", f"checkpoints/{BEFORE}{SIDECAR}")
    assert remote_at < min(uploads) and max(uploads) < published < retire < listing[-1][0]
    assert listing[-1][1] == "marker"  # the run marker last of all
    local_sidecar = _first(listing, "os.rename", f"{STEPS}.sha256.tmp")
    print(
        f"bucket save of step {STEPS}: {len(listing)} I/O boundaries, {len(listing) - remote_at + 1} remote"
    )
    killed_at: dict[str, str] = {}
    tries = itertools.count()

    def check(spec: str) -> None:
        name = f"kill-{next(tries)}"
        url, own = f"{bucket}/runs/{name}", tmp_path / f"{name}.txt"
        done = _train(url, tokens, quiet, fault=f"from={STEPS},{spec},list={own}")
        seen = _read_listing(own)
        if done.returncode == 0 and spec.startswith("kill=") and "at=" not in spec:
            # a numbered boundary this run's save did not reach (fewer data files than the listing's)
            assert len(seen) < int(spec.split("=")[1]) and storage.is_published(url), done.stdout
            return
        # (uploads run side by side: others may have been listed after the one killed at)
        said = re.search(r"SIGKILL at boundary (\d+) \((\S+) (.+)\)\n", done.stdout)
        assert done.returncode == -9 and said, done.stdout
        n, kind, target = int(said[1]), said[2], said[3]
        assert seen[n - 1] == (n, kind, target), seen
        killed_at[spec] = _where(kind, target, url)
        sidecar_up = any(
            _where(k, t, url) == f"upload checkpoints/{STEPS}{SIDECAR}" for _, k, t in seen[: n - 1]
        )
        expect = STEPS if sidecar_up else BEFORE
        steps = remote.published_steps(url)
        assert steps and steps[0] == expect, f"published after the kill: {steps}"
        with tempfile.TemporaryDirectory() as tmp:  # the newest published one is whole
            assert remote.fetch_checkpoint(url, expect, Path(tmp)) is None
        assert not storage.is_published(url)
        shutil.rmtree(remote.local_copy(url))  # a fresh machine: all it has is the bucket
        _resumed(_train(url, tokens, quiet, "--resume"), expect)
        assert remote.published_steps(url) == [STEPS] and storage.is_published(url)
        rows = [json.loads(x) for x in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]
        shutil.rmtree(remote.local_copy(url))
        _same_run(rows, final_params(remote.fetch_run(url, "test"), STEPS), straight)

    # By number up to the last checkpoint file's upload (a run with fewer files meets the sidecar's
    # upload or a delete there instead); by name after it, where the numbers move.
    numbered = [1, local_sidecar, local_sidecar + 1, *range(remote_at, max(uploads) + 1)]
    named = [
        f"{kind}:{_where(kind, target, ref).split(' ', 1)[1]}" for _, kind, target in listing[published - 1 :]
    ]
    cases = {f"boundary {n}": f"kill={n}" for n in numbered} | {
        f"the first {at}": f"kill=1,at={at}" for at in named
    }
    _in_pairs(check, cases)
    wanted = {_where(kind, target, ref) for _, kind, target in listing[remote_at - 1 :]}
    assert wanted <= set(killed_at.values()), f"never killed at: {sorted(wanted - set(killed_at.values()))}"
    print(f"killed at {len(killed_at)} boundaries, every remote one of the listing among them")


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stdout.splitlines() if not line.startswith("shipyard: ")]
    assert done.returncode == 4 and len(lines) == 1 and lines[0].startswith("error: "), done.stdout
    return lines[0]


def test_an_injected_enospc_at_every_boundary_gives_one_line_and_loses_nothing(tmp_path, tokens, straight):
    listing = _listing(tmp_path / "listing", tokens, tmp_path)
    sidecar = _first(listing, "os.rename", f"{STEPS}.sha256.tmp")
    failed = []

    def check(n: int) -> None:
        run = tmp_path / f"enospc-{n}"
        done = _train(run, tokens, fault=f"from={STEPS},enospc={_named(listing, n)}")
        directory = run / "checkpoints"
        if done.returncode == 0:  # Orbax's remove-if-present calls ignore any OSError: the save went on
            assert listing[n - 1][1] == "os.remove" and verified(directory, STEPS) is None, done.stdout
            return
        line = _one_error_line(done)
        assert "No space left on device (injected)" in line and "--resume" in line, line
        kept = STEPS if n > sidecar else BEFORE
        assert f"checkpoint {kept} is intact" in line, line
        said = []
        step, _ = restore_latest(directory, None, say=said.append)
        assert step == kept and verified(directory, kept) is None, said
        failed.append(n)
        if n in (2, sidecar, sidecar + 1):  # an Orbax write, the sidecar, retention: resumed for real
            _resumed(_train(run, tokens, "--resume"), kept)
            _same_run(logged_rows(run), final_params(run, STEPS), straight)

    _in_pairs(check, _each(listing))
    assert len(failed) >= len(listing) // 2, f"only boundaries {failed} failed the run"


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of the test's own (root only): room for the run, and a disk to fill."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a tmpfs of the test's own needs root (CI runs as root)")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_that_fills_up_mid_save_gives_one_line_and_loses_nothing(small_disk, tokens, straight):
    """A real full disk: the file system filled at a boundary inside the save, so tensorstore's array
    writes (C++, which the injected ENOSPC cannot reach), Orbax's commit, the sidecar and the logs
    all meet ENOSPC. One line, the previous checkpoint intact; space freed, --resume ends bitwise."""
    listing = _listing(small_disk / "listing", tokens, small_disk)
    shutil.rmtree(small_disk / "listing")
    arrays = _first(listing, "os.mkdir", "default.orbax-checkpoint-tmp")  # before the array writes
    sidecar = _first(listing, "open", f"{STEPS}.sha256.tmp")  # before its bytes are written
    for n in (1, arrays, sidecar):
        run = small_disk / f"full-{n}"
        line = _one_error_line(_train(run, tokens, fault=f"from={STEPS},fill={n}"))
        assert "No space left on device" in line and f"checkpoint {BEFORE} is intact" in line, line
        (run / ".chaos-fill").unlink()  # the user frees space
        _resumed(_train(run, tokens, "--resume"), BEFORE)
        _same_run(logged_rows(run), final_params(run, STEPS), straight)
        shutil.rmtree(run)
