"""An expert-parallel MoE run SIGKILLed twice (once mid-save, after a resume) resumes to the same bits."""

import random
import signal
import threading
import time

import numpy as np
import pytest
from kill_fixtures import final_params, logged_losses, logged_rows, saves_in_progress, start_train, wait_until

STEPS = 30
WARMUP = 4
EVERY = 5
EXPERT_PARALLEL = "mesh {'pipeline': 1, 'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 1, 'expert': 4}"


def _args(tokens) -> list[str]:
    return [
        "moe-tiny",
        f"data.train_tokens={tokens}",
        "data.seq_len=64",
        f"train.steps={STEPS}",
        f"train.schedule.warmup_steps={WARMUP}",
        "mesh.data=2",
        "mesh.expert=4",
        "model.moe.bias_update_rate=0.01",  # the balancing rule's state must survive the kills too
        "train.logging.log_every=1",
        "train.logging.progress=false",
        f"train.checkpoint.every={EVERY}",
    ]


def _finish(proc, what: str) -> str:
    # Read through the process's text stream, not communicate(): communicate reads the raw pipe, so
    # the lines `_resume`'s readline had already buffered past "resumed from checkpoint" (the mesh
    # line, when the run wrote both at once) were lost, and the check below failed now and then.
    timer = threading.Timer(300, proc.kill)
    timer.start()
    try:
        out = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
    assert proc.returncode == 0, f"{what}:\n{out}"
    return out


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _resume(run, args) -> tuple:
    """(the resumed run, the checkpoint it resumed from), once it has said so (by then it has
    dropped the metrics the killed run logged after that checkpoint)."""
    proc = start_train(run, [*args, "--resume"], devices=8)
    said = ""
    while "resumed from checkpoint" not in said:
        line = proc.stdout.readline()
        assert line, f"the resumed run ended before resuming:\n{said}"
        said += line
    return proc, int(said.split("resumed from checkpoint ")[1].split()[0])


def _complete_checkpoints(run) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_expert_parallel_run_killed_at_random_moments_resumes_bitwise(tmp_path, byte_tokens):
    args = _args(byte_tokens)
    straight = tmp_path / "straight"
    out = _finish(start_train(straight, args, devices=8), "the straight run")
    assert EXPERT_PARALLEL in out

    run, rng = tmp_path / "run", random.Random(22)
    proc, start = start_train(run, args, devices=8), 0
    # Two SIGKILLs past the warmup, each after the run passed the checkpoint it resumed from: at a
    # seeded random step (plus a random fraction of a step), then in the middle of a checkpoint save
    # of the resumed run (a third kill at a step only repeated the first: 25 s).
    for moment in ("step", "save"):
        # an earlier kill may have left a half-written save behind: only new ones count
        stale = set(saves_in_progress(run))
        if moment == "save":
            target = max(start, WARMUP) + EVERY

            def saving(t=target, stale=stale):
                return any(int(n.split(".")[0]) >= t for n in set(saves_in_progress(run)) - stale)

            wait_until(proc, saving)
        else:
            target = rng.randint(max(start, WARMUP) + 2, max(start, WARMUP) + 8)

            # Saves are asynchronous: on a loaded machine the run can log steps past a
            # checkpoint before that checkpoint is complete. Wait for both, so every kill
            # leaves a newer complete checkpoint than the one this run resumed from.
            def past(t=target, start=start):
                done = _complete_checkpoints(run) if (run / "checkpoints").is_dir() else []
                return max(logged_losses(run), default=-1) >= t and max(done, default=-1) > start

            wait_until(proc, past)
            time.sleep(rng.uniform(0.0, 0.3))
        _kill(proc)
        logged = max(logged_losses(run), default=-1)
        assert WARMUP < logged < STEPS - 1, f"killed after step {logged}"
        if moment == "save":
            assert set(saves_in_progress(run)) - stale, "the save finished before the kill"
        newest = _complete_checkpoints(run)[-1]
        proc, start = _resume(run, args)
        assert start == newest  # a half-written save is never picked
        print(f"SIGKILL ({moment}) after step {logged} was logged; resumed from checkpoint {start}")
    out = _finish(proc, "the last resumed run")
    assert EXPERT_PARALLEL in out
    # every step logged once, in order (what the killed runs logged past their checkpoint is gone)
    assert [row["step"] for row in logged_rows(run)] == list(range(STEPS))
    a, b = logged_losses(straight), logged_losses(run)
    assert all(a[s] == b[s] for s in range(STEPS)), (a, b)  # bitwise: float equality
    for x, y in zip(final_params(straight, STEPS), final_params(run, STEPS), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
