"""A run directory in a bucket (`--run-dir s3://bucket/runs/x`): trained in a local working copy,
published to the bucket as it goes; the bucket is the truth on resume.

Orbax 0.12.8 cannot address `s3://` (it normalises the URL to `s3:/...` and refuses it as a
relative path), and an object store has no rename to make a checkpoint appear whole. So a run
works in a local working copy (`local_copy`: under the user cache, `$SHIPYARD_RUN_CACHE` to put it
elsewhere), where Orbax's atomic rename and the sha256 sidecar work as for any run, and a
`Publisher` thread uploads, in order and with retries (storage.py):

- the run's files (config.yaml, provenance.json, metrics.jsonl, tb/, tokenizer/, ...), before
  each checkpoint and at the end: what changed since the last upload;
- each checkpoint once Orbax has finalised it and its `<step>.sha256.json` is written, after the
  metrics of the steps before it are logged: its files first, the sidecar last. The sidecar is the
  checkpoint's marker in the bucket: a checkpoint without one, or whose files do not match it, is
  never taken;
- the deletion of checkpoints the run's `keep` policy drops: sidecar first, then the files;
- when the run finished, the run marker `_SUCCESS`, last (deleted first when a run starts).

`--resume` rebuilds the working copy from the bucket alone (`pull_run`: the run files and the
newest checkpoint whose files download and match its sidecar, older ones on failure), so a run
continues on a fresh machine exactly as a local resume does. Readers of a run URL (`fetch_run`,
through runs.open_model_dir) get a verified copy of its newest published checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from shipyard import storage
from shipyard.config import CheckpointConfig
from shipyard.data.hashcache import sha256_files
from shipyard.errors import ConfigError, RunDirError
from shipyard.output import write_atomic
from shipyard.run import fault_injection
from shipyard.run.checkpoint import SIDECAR, checkpoint_dir, doomed_steps
from shipyard.storage import StorageError, redact
from shipyard.user_cache import user_cache

RUN_MARKER = storage.MARKER
CACHE_ENV = "SHIPYARD_RUN_CACHE"
CHECKPOINTS = "checkpoints"
UPLOADERS = 8
"""Files of a checkpoint uploaded at once."""
READER_SKIPS = ("tb/", "profile/", "metrics.jsonl")
"""Run files a reader of the model does not need (and that can be large)."""

Say = Callable[[str], None]


def local_copy(url: str, kind: str = "runs") -> Path:
    """Where the local copy of the run at `url` lives: `$SHIPYARD_RUN_CACHE/<kind>/<key>`, else
    `$XDG_CACHE_HOME/shipyard/<kind>/<key>` (~/.cache by default), keyed by the sha256 of the
    redacted URL. `kind` "runs" is a training working copy, "run-reads" a reader's copy (apart, so
    a reader never replaces the copy a run on the same machine trains in)."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        base = str(user_cache())
    key = hashlib.sha256(redact(url).rstrip("/").encode()).hexdigest()[:20]
    return Path(base) / kind / key


def _ckpt_url(url: str, *names: str) -> str:
    return str(storage.join(url, CHECKPOINTS, *names))


def published_steps(url: str) -> list[int]:
    """Steps of the checkpoints published at `url` (their sidecar exists), newest first."""
    steps = set()
    for name in storage.list_files(_ckpt_url(url)):
        stem = name[: -len(SIDECAR)]
        if "/" not in name and name.endswith(SIDECAR) and stem.isdigit():
            steps.add(int(stem))
    return sorted(steps, reverse=True)


def _read_sidecar(url: str, step: int) -> tuple[bytes, dict[str, str]] | str:
    """(the sidecar's bytes, {file: sha256}) of published checkpoint `step`, or what is wrong."""
    try:
        text = storage.read_bytes(_ckpt_url(url, f"{step}{SIDECAR}"))
    except StorageError as e:
        return f"its sidecar cannot be read ({e})"
    try:
        recorded = json.loads(text)
    except ValueError:
        return "its sidecar is not JSON"
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        return "its sidecar is not a {file: sha256} object"
    return text, recorded


def fetch_checkpoint(url: str, step: int, directory: Path) -> str | None:
    """Download published checkpoint `step` into `directory`/<step> (and its sidecar next to it),
    verified against the sidecar's sha256s; None when it arrived whole, else what is wrong (and
    nothing of it is left in `directory`)."""
    got = _read_sidecar(url, step)
    if isinstance(got, str):
        return got
    text, recorded = got
    step_dir = Path(directory) / str(step)
    try:
        storage.download_dir(_ckpt_url(url, str(step)), step_dir, sorted(recorded))
    except StorageError as e:
        shutil.rmtree(step_dir, ignore_errors=True)
        return f"a file of it cannot be downloaded ({e})"
    actual = sha256_files(step_dir, sorted(recorded), fresh=True)
    bad = next((n for n, digest in sorted(recorded.items()) if actual.get(n) != digest), None)
    if bad is not None:
        shutil.rmtree(step_dir)
        return f"file {bad} does not match its recorded sha256 (truncated or corrupted)"
    write_atomic(Path(directory) / f"{step}{SIDECAR}", text.decode())
    return None


def _run_files(url: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The run's files at `url` besides its checkpoints and its marker."""
    return [
        n
        for n in storage.list_files(url)
        if not n.startswith(CHECKPOINTS + "/") and n != RUN_MARKER and not n.startswith(skip)
    ]


def pull_run(url: str, work: Path, say: Say) -> int | None:
    """Rebuild the working copy `work` from the bucket alone: the run's files and the newest
    published checkpoint that downloads and verifies (older ones on failure, saying why). The step
    pulled; None when the bucket holds no published checkpoint (the run starts from step 0)."""
    if work.exists():
        shutil.rmtree(work)
    storage.download_dir(url, work, _run_files(url))
    steps = published_steps(url)
    where = redact(url)
    for step in steps:
        problem = fetch_checkpoint(url, step, checkpoint_dir(work))
        if problem is None:
            say(f"shipyard: --resume: checkpoint {step} of {where} downloaded and verified into {work}")
            return step
        older = [s for s in steps if s < step]
        fallback = (
            f"falling back to checkpoint {older[0]}" if older else "no older checkpoint to fall back to"
        )
        say(f"shipyard: checkpoint {step} in {where} is unusable: {problem}; {fallback}")
    if steps:
        raise RunDirError(f"--resume: no usable checkpoint in {where} (all {len(steps)} failed; see above)")
    return None


def open_remote(url: str, resume: bool, overwrite: bool, say: Say) -> Path:
    """Prepare the working copy of the run at `url` (process 0): pulled from the bucket for
    `--resume`, else fresh (a run already in the bucket is refused unless `overwrite`). The run
    marker is deleted first either way: the run is in progress until it is published again."""
    work, where = local_copy(url), redact(url)
    if not urlsplit(url).path.strip("/"):
        raise ConfigError(
            f"--run-dir {where}: a bucket itself, not a prefix in it; give one such as {where.rstrip('/')}/runs/NAME"
        )
    if resume:
        step = pull_run(url, work, say)
        if step is None and storage.list_files(url):
            # no published checkpoint: what is there is a run killed before its first one
            say(f"shipyard: --resume: no published checkpoint in {where}; starting the run from step 0")
            storage.remove(url)
    else:
        held = sorted({n.split("/")[0] for n in storage.list_files(url)} - {RUN_MARKER})
        if held and not overwrite:
            raise RunDirError(
                f"run directory {where} already holds a run ({', '.join(held[:4])}); pass --resume "
                "to continue it, --overwrite to replace it, or choose another --run-dir"
            )
        storage.remove(str(storage.join(url, RUN_MARKER)))
        storage.remove(url)
        if work.exists():
            shutil.rmtree(work)
    storage.remove(str(storage.join(url, RUN_MARKER)))
    _drop_unpublished(url)
    work.mkdir(parents=True, exist_ok=True)
    say(
        f"shipyard: run directory {where}: working copy {work}; checkpoints and run files are published as they finish"
    )
    return work


def _drop_unpublished(url: str) -> None:
    """Delete checkpoint files in the bucket that have no sidecar (an upload cut short)."""
    published = set(published_steps(url))
    stems = {n.split("/")[0] for n in storage.list_files(_ckpt_url(url)) if "/" in n}
    for stem in sorted(stems):
        if not (stem.isdigit() and int(stem) in published):
            storage.remove(_ckpt_url(url, stem))


def _upload(local: Path, url: str) -> bool:
    """Put local file `local` at `url` (streamed, retried); False when the file is gone locally."""
    fault_injection.boundary("upload", redact(url))
    fs, path = storage.filesystem(url)
    try:
        storage.retrying(lambda: fs.put_file(str(local), path), f"uploading {redact(url)}")
    except StorageError:
        if not local.exists():
            return False
        raise
    return True


def _delete(url: str) -> None:
    """Delete `url` (a file or everything under a prefix) from the bucket: one I/O boundary."""
    fault_injection.boundary("delete", redact(url))
    storage.remove(url)


def publish_checkpoint(work: Path, url: str, step: int) -> bool:
    """Upload checkpoint `step` of working copy `work`: an earlier sidecar of that step deleted
    first, then its files, then its sidecar, last. False when it is gone locally (dropped by the
    keep policy before its turn came: a newer one follows)."""
    directory = checkpoint_dir(work)
    sidecar = directory / f"{step}{SIDECAR}"
    try:
        names = sorted(json.loads(sidecar.read_text()))
    except FileNotFoundError:
        return False
    base = _ckpt_url(url, str(step))
    _delete(_ckpt_url(url, f"{step}{SIDECAR}"))
    _delete(base)
    # The files go up side by side (a store's latency, not its bandwidth, bounds one PUT after
    # another); the sidecar only once every one of them is there.
    with ThreadPoolExecutor(UPLOADERS) as pool:
        sent = list(pool.map(lambda n: _upload(directory / str(step) / n, f"{base}/{n}"), names))
    if not all(sent):
        _delete(base)
        return False
    return _upload(sidecar, _ckpt_url(url, f"{step}{SIDECAR}"))


def unpublish_checkpoint(url: str, step: int) -> None:
    """Delete checkpoint `step` from the bucket: its sidecar first, so it is never half there."""
    _delete(_ckpt_url(url, f"{step}{SIDECAR}"))
    _delete(_ckpt_url(url, str(step)))


class Publisher:
    """Publishes a working copy to its bucket from one background thread, in the order the
    module docstring gives; `close` publishes the final state (and the run marker)."""

    def __init__(self, work: Path, url: str, ckpt: CheckpointConfig, say: Say):
        self.work, self.url, self.ckpt, self.say = Path(work), url, ckpt, say
        self._jobs: queue.Queue = queue.Queue()
        self._sent: dict[str, tuple[int, int]] = {}
        self._failed: list[int] = []
        self._logged = -1
        self._closing = False
        self._cond = threading.Condition()
        self._final_error: StorageError | None = None
        self._crash: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="shipyard-publish", daemon=True)
        self._thread.start()

    def step_logged(self, step: int) -> None:
        """The metrics of `step` are in metrics.jsonl."""
        with self._cond:
            self._logged = max(self._logged, step)
            self._cond.notify_all()

    def checkpoint_hashed(self, step: int) -> None:
        """Checkpoint `step` is final and its sidecar written: publish it (after step-1's metrics)."""
        self._jobs.put(step)

    def sync_files(self) -> None:
        self._jobs.put("files")

    def close(self, complete: bool) -> None:
        """Publish everything not yet published, then (when `complete`: the run ended normally) the
        run marker; raises StorageError when the store stayed unreachable past the retries."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._jobs.put(("final", complete))
        self._jobs.put(None)
        self._thread.join()
        if self._crash is not None:
            raise self._crash
        if self._final_error is not None:
            raise StorageError(
                f"{self._final_error}; the run's working copy {self.work} holds everything: rerun the same "
                "command on this machine with --resume once the store is reachable (bucket copy incomplete)"
            )

    def wait_idle(self) -> None:
        """Return once every job queued so far is done (the fault-injection switch's settle)."""
        self._jobs.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job == "files":
                    self._sync_files()
                elif isinstance(job, int):
                    self._checkpoint(job)
                else:
                    self._final(job[1])
            except StorageError as e:
                if isinstance(job, tuple):
                    self._final_error = e
                else:  # the final publication tries everything again
                    self._failed += [job] if isinstance(job, int) else []
                    self.say(
                        f"shipyard: publishing to {redact(self.url)}: {e}; trying again at the end of the run"
                    )
            except Exception as e:  # a bug: kept for close() to raise; the thread goes on with the rest
                self._crash = self._crash or e
            finally:
                self._jobs.task_done()

    def _checkpoint(self, step: int) -> None:
        with self._cond:  # the metrics up to the checkpoint go up before it
            self._cond.wait_for(lambda: self._logged >= step - 1 or self._closing)
        self._sync_files()
        publish_checkpoint(self.work, self.url, step)
        self._retire()

    def _retire(self) -> None:
        """The keep policy over the published checkpoints."""
        for old in doomed_steps(published_steps(self.url), self.ckpt):
            unpublish_checkpoint(self.url, old)

    def _final(self, complete: bool) -> None:
        failed, self._failed = sorted(set(self._failed)), []
        for step in failed:  # what a long outage kept from going up (still local unless dropped since)
            self._checkpoint(step)
        # The keep policy once more: a run killed after publishing its last checkpoint but before
        # retiring older ones, then resumed there, publishes no checkpoint that would retire them.
        self._retire()
        self._sync_files()
        if complete:
            fault_injection.boundary("marker", redact(str(storage.join(self.url, RUN_MARKER))))
            storage.write_bytes(str(storage.join(self.url, RUN_MARKER)), b"")

    def _run_files(self) -> list[Path]:
        """The run's files, checkpoints/ not entered (retention renames and deletes there while
        this walks, and those files go their own way); a directory gone mid-walk is skipped."""
        found = []
        for root, dirs, files in os.walk(self.work):  # errors (a directory gone) are skipped
            if Path(root) == self.work:
                dirs[:] = [d for d in dirs if d != CHECKPOINTS]
            found += [Path(root) / name for name in files]
        return sorted(found)

    def _sync_files(self) -> None:
        """Upload the run's files (all but checkpoints/) that changed since their last upload."""
        for path in self._run_files():
            rel = path.relative_to(self.work).as_posix()
            if path.name.startswith("."):
                continue  # write_atomic's temporaries
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_size, st.st_mtime_ns)
            if self._sent.get(rel) != stamp and _upload(path, str(storage.join(self.url, rel))):
                self._sent[rel] = stamp


class PublishedLog:
    """The loop's step log, telling the publisher each step it has logged (a checkpoint is
    published after the metrics of the steps before it, so a resume from the bucket has them)."""

    def __init__(self, log, publisher: Publisher):
        self.log, self.publisher = log, publisher

    def finish(self, step: int, metrics: dict, val_sums) -> None:
        self.log.finish(step, metrics, val_sums)
        self.publisher.step_logged(step)

    def elapsed(self) -> float:
        return self.log.elapsed()

    def close(self) -> None:
        self.log.close()


def fetch_run(url: str, what: str) -> Path:
    """A local copy of the run at `url` for a reader (export, generate, chat, serve, eval,
    train.init_from): its config, tokenizer and other small run files and its newest published
    checkpoint, downloaded and verified into the user cache (`local_copy(url, "run-reads")`),
    reused while that checkpoint is still the newest. A newest checkpoint that does not verify
    is refused, as for a local run (no silent fallback)."""
    where = redact(url)
    steps = published_steps(url)
    if not steps or not storage.exists(str(storage.join(url, "config.yaml"))):
        raise RunDirError(
            f"{what}: {where} holds no published run (expected the run directory of `shipyard train "
            f"--run-dir {where}`: config.yaml and checkpoints/<step> with its <step>{SIDECAR})"
        )
    dest, step = local_copy(url, "run-reads"), steps[0]
    got = _read_sidecar(url, step)
    if isinstance(got, str):
        raise RunDirError(f"{what}: checkpoint {step} of {where} is unusable: {got}")
    kept = checkpoint_dir(dest) / f"{step}{SIDECAR}"
    if kept.is_file() and kept.read_bytes() == got[0] and (dest / "config.yaml").is_file():
        from shipyard.run.checkpoint import verify_checksums

        if verify_checksums(checkpoint_dir(dest), step) is None:
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        storage.download_dir(url, tmp / "run", _run_files(url, READER_SKIPS))
        problem = fetch_checkpoint(url, step, checkpoint_dir(tmp / "run"))
        if problem is not None:
            raise RunDirError(f"{what}: checkpoint {step} of {where} is unusable: {problem}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp / "run", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def model_path(path: str | Path, what: str) -> Path:
    """A model directory as a local path: a run URL fetched (`fetch_run`), a path as it is."""
    return fetch_run(str(path), what) if storage.is_url(path) else Path(path)
