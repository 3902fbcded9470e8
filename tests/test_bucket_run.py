"""Run directories in a bucket (run/remote.py) against moto's S3 server on 127.0.0.1.

Default tier, without training (synthetic checkpoint files): the publication order (a
checkpoint's files, then its sidecar last; deletion sidecar first) and the rule that resume and
readers never take a checkpoint that is half there (files without a sidecar, a sidecar whose files
are missing or short). Slow tier: a `tiny` run with its run directory in the bucket, through a
proxy that drops connections, SIGKILLed at a random step and mid-upload, resumed each time on a
"fresh machine" (its working copy deleted), bitwise equal to a straight run."""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from kill_fixtures import final_params, logged_losses, logged_rows, start_train, wait_until
from s3_fixtures import SECRET_KEY, FaultProxy

from shipyard import storage
from shipyard.config import CheckpointConfig
from shipyard.errors import RunDirError
from shipyard.run import remote
from shipyard.run.checkpoint import SIDECAR, checkpoint_dir, verify_checksums, write_checksums


def _fake_checkpoint(work: Path, step: int) -> list[str]:
    """A checkpoint-shaped step directory (a few files of step-dependent bytes) and its sidecar."""
    step_dir = checkpoint_dir(work) / str(step)
    names = ["_CHECKPOINT_METADATA", "default/manifest.ocdbt", "default/d/0a1b", "default/d/2c3d"]
    for i, name in enumerate(names):
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(bytes([step, i]) * (200 + 50 * i))
    write_checksums(checkpoint_dir(work), step)
    return names


def _work(tmp_path: Path, steps) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.yaml").write_text("run: {}\n")
    (work / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    for step in steps:
        _fake_checkpoint(work, step)
    return work


def test_a_checkpoint_is_published_files_first_sidecar_last_and_deleted_sidecar_first(
    tmp_path, bucket, monkeypatch
):
    url = f"{bucket}/runs/order"
    work = _work(tmp_path, [5, 10])
    events: list[tuple[str, str]] = []
    upload, remove = remote._upload, storage.remove

    def recording_upload(local, to):
        events.append(("put", to[len(url) + 1 :]))
        return upload(local, to)

    def recording_remove(prefix, *a, **k):
        events.append(("rm", prefix[len(url) + 1 :]))
        return remove(prefix, *a, **k)

    monkeypatch.setattr(remote, "_upload", recording_upload)
    monkeypatch.setattr(storage, "remove", recording_remove)
    assert remote.publish_checkpoint(work, url, 5)
    puts = [name for kind, name in events if kind == "put"]
    assert puts[-1] == f"checkpoints/5{SIDECAR}"  # the marker, after every file of the checkpoint
    assert sorted(puts[:-1]) == sorted(
        f"checkpoints/5/{n}" for n in json.loads((checkpoint_dir(work) / f"5{SIDECAR}").read_text())
    )
    # republishing a step deletes its old sidecar before anything else
    assert events[0] == ("rm", f"checkpoints/5{SIDECAR}")
    assert remote.published_steps(url) == [5]
    events.clear()
    remote.unpublish_checkpoint(url, 5)
    assert [e for e in events if e[0] == "rm"][:2] == [
        ("rm", f"checkpoints/5{SIDECAR}"),
        ("rm", "checkpoints/5"),
    ]
    assert remote.published_steps(url) == [] and storage.list_files(f"{url}/checkpoints") == []


def test_the_keep_policy_in_the_bucket_is_orbaxs():
    cfg = CheckpointConfig(keep=2, keep_every=10)
    assert remote.doomed_steps([5, 10, 15, 20, 25], cfg) == [5, 15]
    assert remote.doomed_steps([5, 10], CheckpointConfig(keep=None)) == []


def test_resume_and_readers_never_take_a_half_uploaded_checkpoint(tmp_path, bucket, monkeypatch):
    """Checkpoint 5 is whole; 10 has its files but no sidecar (an upload killed before its marker);
    15's sidecar is there but one file is short; 20's sidecar is there but a file is missing.
    --resume takes 5, saying why 20 and 15 are unusable; the reader refuses the newest (20)."""
    monkeypatch.setenv("SHIPYARD_RUN_CACHE", str(tmp_path / "cache"))
    url = f"{bucket}/runs/half"
    work = _work(tmp_path, [5, 10, 15, 20])
    for step in (5, 10, 15, 20):
        assert remote.publish_checkpoint(work, url, step)
    storage.remove(f"{url}/checkpoints/10{SIDECAR}")
    short = f"{url}/checkpoints/15/default/d/2c3d"
    storage.write_bytes(short, storage.read_bytes(short)[:-7])
    storage.remove(f"{url}/checkpoints/20/default/manifest.ocdbt")
    for name in ("config.yaml", "metrics.jsonl"):
        storage.write_bytes(f"{url}/{name}", (work / name).read_bytes())
    assert remote.published_steps(url) == [20, 15, 5]

    fresh = remote.local_copy(url)
    said: list[str] = []
    assert remote.pull_run(url, fresh, said.append) == 5
    assert said[0].startswith(
        f"shipyard: checkpoint 20 in {url} is unusable: a file of it cannot be downloaded"
    )
    assert "falling back to checkpoint 15" in said[0]
    assert said[1] == (
        f"shipyard: checkpoint 15 in {url} is unusable: file default/d/2c3d does not match its recorded "
        "sha256 (truncated or corrupted); falling back to checkpoint 5"
    )
    assert "checkpoint 5 of" in said[2] and len(said) == 3
    ckpts = checkpoint_dir(fresh)
    assert sorted(p.name for p in ckpts.iterdir()) == ["5", f"5{SIDECAR}"]  # nothing of 10, 15, 20
    assert verify_checksums(ckpts, 5) is None
    assert (fresh / "metrics.jsonl").read_bytes() == (work / "metrics.jsonl").read_bytes()

    # opening the run for --resume drops the sidecar-less files of 10 from the bucket
    remote.open_remote(url, resume=True, overwrite=False, say=said.append)
    assert not [n for n in storage.list_files(f"{url}/checkpoints") if n.startswith("10/")]

    with pytest.raises(RunDirError, match=r"^eval: checkpoint 20 of s3://\S+ is unusable: a file of it"):
        remote.fetch_run(url, "eval")
    remote.unpublish_checkpoint(url, 20)
    with pytest.raises(RunDirError, match="checkpoint 15 .* does not match its recorded sha256"):
        remote.fetch_run(url, "eval")
    remote.unpublish_checkpoint(url, 15)
    got = remote.fetch_run(url, "eval")  # the reader's copy: the newest published, verified
    assert sorted(p.name for p in checkpoint_dir(got).iterdir()) == ["5", f"5{SIDECAR}"]
    assert remote.fetch_run(url, "eval") == got  # current: reused


def test_a_run_in_the_bucket_is_not_overwritten_without_asking(tmp_path, bucket, monkeypatch):
    monkeypatch.setenv("SHIPYARD_RUN_CACHE", str(tmp_path / "cache"))
    url = f"{bucket}/runs/taken"
    storage.write_bytes(f"{url}/config.yaml", b"run: {}\n")
    with pytest.raises(RunDirError, match=r"already holds a run \(config.yaml\); pass --resume"):
        remote.open_remote(url, resume=False, overwrite=False, say=print)
    assert storage.list_files(url) == ["config.yaml"]
    remote.open_remote(url, resume=False, overwrite=True, say=print)
    assert storage.list_files(url) == []


STEPS, EVERY, WARMUP = 40, 5, 3


def _args(tokens) -> list[str]:
    return [
        "tiny",
        f"data.train_tokens={tokens}",
        f"train.steps={STEPS}",
        f"train.schedule.warmup_steps={WARMUP}",
        "train.logging.log_every=1",
        "train.logging.progress=false",
        f"train.checkpoint.every={EVERY}",
    ]


def _kill(proc) -> str:
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return out


def _resume(url: str, args: list[str]):
    """A run resumed on a fresh machine: its working copy is deleted first, so all it has is the
    bucket. (the process, the checkpoint it resumed from, what it said up to there)."""
    shutil.rmtree(remote.local_copy(url), ignore_errors=True)
    proc = start_train(url, [*args, "--resume"])
    said = ""
    while "resumed from checkpoint" not in said:
        line = proc.stdout.readline()
        assert line, f"the resumed run ended before resuming:\n{said}"
        said += line
    return proc, int(said.split("resumed from checkpoint ")[1].split()[0]), said


def _partial_upload(url: str, work: Path, after: int) -> bool:
    """Whether the bucket holds some files of a checkpoint newer than `after`, at least 3 short of
    all of them, and not its sidecar: an upload in flight (killing now leaves it half there)."""
    time.sleep(0.02)  # a listing at most every few tens of ms: the server also serves the run
    names = storage.list_files(f"{url}/checkpoints")
    for sidecar in checkpoint_dir(work).glob(f"*{SIDECAR}"):
        step = sidecar.name[: -len(SIDECAR)]
        if not step.isdigit() or int(step) <= after or f"{step}{SIDECAR}" in names:
            continue
        try:
            total = len(json.loads(sidecar.read_text()))
        except (OSError, ValueError):
            continue
        there = sum(n.startswith(f"{step}/") for n in names)
        if 0 < there <= total - 3:
            return True
    return False


def _scan_for_secret(root: Path, url: str, outputs: list[str]) -> None:
    secret = SECRET_KEY.encode()
    for path in root.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path
    for name in storage.list_files(url):
        assert secret not in storage.read_bytes(f"{url}/{name}"), name
    for out in outputs:
        assert SECRET_KEY not in out


@pytest.mark.slow
def test_bucket_run_sigkilled_at_a_step_and_mid_upload_resumes_bitwise(
    tmp_path, byte_tokens, bucket, s3_server, monkeypatch
):
    """A run reading its tokens from the bucket with its run directory there, every request
    through a proxy that resets every 25th connection: SIGKILLed at a seeded random step and
    again while a checkpoint is half uploaded, resumed each time with its working copy deleted (a
    fresh machine: the bucket is the truth). The half-uploaded checkpoint is never taken; the
    losses and final params are bitwise those of a straight local run; the run is published with
    its marker; no credential is written anywhere."""
    args = _args(byte_tokens)
    straight = tmp_path / "straight"
    proc = start_train(straight, args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    # the bucket run reads its tokens from the bucket too (ranged GETs: data/shards.py)
    tokens = f"{bucket}/data/tokens.npy"
    storage.write_bytes(tokens, byte_tokens.read_bytes())
    args = _args(tokens)
    proxy = FaultProxy(s3_server.port, drop_every=25)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("SHIPYARD_RUN_CACHE", str(tmp_path / "cache"))
    url = f"{bucket}/runs/tiny"
    work = remote.local_copy(url)
    outputs, rng = [], random.Random(21)
    proc, start = start_train(url, args), 0
    # A SIGKILL at a seeded random step, then kills while a checkpoint is half uploaded: the server
    # is stopped (SIGSTOP) the moment a listing shows part of one, so its sidecar cannot follow
    # before the kill lands; an upload that still won the race is simply tried again.
    half = False
    for moment in ("step", "upload", "upload", "upload"):
        if moment == "step":
            target = rng.randint(WARMUP + 2 * EVERY, WARMUP + 3 * EVERY)

            def past(t=target):  # a logged step past `target`, and a checkpoint published after 0
                if max(logged_losses(work), default=-1) < t:
                    return False
                time.sleep(0.2)  # the server and the proxy also serve the run: list the bucket sparingly
                return bool(remote.published_steps(url))

            wait_until(proc, past)
            time.sleep(rng.uniform(0.0, 0.3))
            outputs.append(_kill(proc))
        else:
            wait_until(proc, lambda start=start: _partial_upload(url, work, start))
            s3_server.pause()
            try:
                outputs.append(_kill(proc))
            finally:
                s3_server.resume()
        logged = max(logged_losses(work), default=-1)
        published = remote.published_steps(url)
        stems = {n.split("/")[0] for n in storage.list_files(f"{url}/checkpoints") if "/" in n}
        half = bool({int(s) for s in stems if s.isdigit()} - set(published))
        proc, start, said = _resume(url, args)
        outputs.append(said)
        assert start == published[0] > 0  # the newest whole one; a half-uploaded one never
        print(
            f"SIGKILL ({moment}) after step {logged}: resumed from checkpoint {start} of {published}; half: {half}"
        )
        if moment == "upload" and half:
            break
    assert half, "no kill landed while a checkpoint was half uploaded"
    out, _ = proc.communicate(timeout=300)
    outputs.append(out)
    assert proc.returncode == 0, out
    assert proxy.dropped > 0  # the faults happened, and were ridden out

    assert storage.is_published(url)  # the run marker: the final state is all there
    assert remote.published_steps(url) == [STEPS, STEPS - EVERY, STEPS - 2 * EVERY]  # keep: 3
    shutil.rmtree(work)  # the bucket alone: the reader's copy of the newest checkpoint, verified
    got = remote.fetch_run(url, "test")
    bucket_rows = [json.loads(x) for x in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in bucket_rows] == list(range(STEPS))  # each step once, in order
    a = logged_losses(straight)
    assert all(a[r["step"]] == r["loss"] for r in bucket_rows)  # bitwise: float equality
    for x, y in zip(final_params(straight, STEPS), final_params(got, STEPS), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert logged_rows(got) == []  # readers do not fetch metrics
    _scan_for_secret(tmp_path / "cache", url, outputs)
    prov = json.loads(storage.read_bytes(f"{url}/provenance.json"))
    assert prov["published_to"] == url and len(prov["resumes"]) == 2


def test_urls_are_recorded_without_credentials(tmp_path, monkeypatch):
    """config.yaml and provenance.json record URLs redacted (storage.redact): a key in a URL's user
    info or query, in the config or on the command line, is never written."""
    from shipyard.config import load_config
    from shipyard.run.rundir import write_run_header

    leaky = f"s3://AKIAEXAMPLE:{SECRET_KEY}@bucket/runs?token={SECRET_KEY}"
    monkeypatch.setattr("sys.argv", ["shipyard", "train", "tiny", f"run.out_dir={leaky}", "--run-dir", leaky])
    cfg = load_config("tiny", [f"run.out_dir={leaky}"])
    write_run_header(tmp_path, cfg, {}, url=leaky)
    for name in ("config.yaml", "provenance.json"):
        text = (tmp_path / name).read_text()
        assert SECRET_KEY not in text and "AKIAEXAMPLE" not in text, name
        assert "s3://bucket/runs" in text
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["argv"][3:] == ["run.out_dir=s3://bucket/runs", "--run-dir", "s3://bucket/runs"]


def test_a_run_url_is_read_like_a_run_directory(tmp_path, bucket, monkeypatch):
    """open_model_dir (export, generate, chat, serve, eval) and train.init_from take a run URL: the
    newest published checkpoint, downloaded and verified, gives the params the run saved."""
    import jax
    from model_fixtures import noisy_params, save_run

    from shipyard.config import load_config
    from shipyard.run.model_dir import open_model_dir
    from shipyard.train.startup import check_init_from

    monkeypatch.setenv("SHIPYARD_RUN_CACHE", str(tmp_path / "cache"))
    cfg = load_config("tiny", [])
    params = noisy_params(cfg.model, key=0, seed=3, scale=0.1)
    save_run(tmp_path / "run", cfg, params)
    url = f"{bucket}/runs/reader"
    storage.write_bytes(f"{url}/config.yaml", (tmp_path / "run" / "config.yaml").read_bytes())
    assert remote.publish_checkpoint(tmp_path / "run", url, 1)
    model = open_model_dir(url, "generate")
    assert model.kind == "run" and model.steps == (1,)
    got = model.load(what="generate")
    assert got.step == 1
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got.params), strict=True):
        assert np.array_equal(np.asarray(a), b)
    check_init_from(load_config("tiny", [f"train.init_from={url}"]))  # exists, same model, verifies
