"""An RL run's saved state, so a killed run resumes where it was, bitwise.

OUT holds rl.yaml (the settings) from the start and state/<step>/ (Orbax: params and optimizer
state) every `save_every` steps, each made complete by state/<step>.json ({"step", "next_prompt"})
written after it. Everything else a step uses is a function of (seed, step): the prompts drawn (from
`next_prompt` on), the replies' seeds, the held-out set. So a rerun of the same command restores the
newest complete state, cuts metrics.jsonl back to that step and runs the same steps again: the same
rollouts, rewards, losses and params (tests/test_rl.py kills a run with SIGKILL to check it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from shipyard.config import RLConfig
from shipyard.errors import ConfigError
from shipyard.output import OutputExists, write_json

STATE = "state"
KEEP = 2
"""Complete states kept (older ones are deleted once a newer one is complete)."""
MAY_CHANGE = ("steps", "eval_every")
"""Settings a resumed run may change: they do not change what the steps before them computed."""


def resumable(out: Path, rl: RLConfig) -> bool:
    """Whether `out` is an unfinished RL run with these settings (False: `out` does not exist); an
    OutputExists for a finished run or another directory, a ConfigError naming settings that differ."""
    if not out.exists():
        return False
    if (out / "config.yaml").is_file() or not (out / "rl.yaml").is_file():
        what = "a finished rl run" if (out / "config.yaml").is_file() else "not an unfinished rl run"
        raise OutputExists(f"rl: {out} already exists ({what}); choose another output directory")
    recorded = yaml.safe_load((out / "rl.yaml").read_text())
    now = rl.model_dump(mode="json")
    differ = [k for k in now if k not in MAY_CHANGE and recorded.get(k) != now[k]]
    if differ:
        shown = ", ".join(f"{k}={recorded.get(k)!r} (now {now[k]!r})" for k in differ)
        raise ConfigError(
            f"rl: {out} is a run with other settings: {shown}; give the same settings to resume, or a new OUT"
        )
    return True


def complete_steps(out: Path) -> list[int]:
    """Steps whose state is complete, newest first."""
    folder = out / STATE
    if not folder.is_dir():
        return []
    return sorted((int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()), reverse=True)


def save(out: Path, step: int, params, opt_state, next_prompt: int) -> None:
    """state/<step> and its completion record; then the older states past KEEP go."""
    import orbax.checkpoint as ocp

    folder = out / STATE
    folder.mkdir(exist_ok=True)
    target = (folder / str(step)).absolute()
    if target.exists():  # an incomplete save of a killed run (no .json): written again
        shutil.rmtree(target)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(target, {"params": params, "opt_state": opt_state})
    write_json(folder / f"{step}.json", {"step": step, "next_prompt": next_prompt})
    for old in complete_steps(out)[KEEP:]:
        (folder / f"{old}.json").unlink()
        shutil.rmtree(folder / str(old), ignore_errors=True)


def restore(out: Path, step: int, params, opt_state) -> tuple:
    """(params, opt_state, next_prompt) of state/<step>, onto the shapes of `params`, `opt_state`."""
    import orbax.checkpoint as ocp

    folder = out / STATE
    record = json.loads((folder / f"{step}.json").read_text())
    with ocp.StandardCheckpointer() as ckpt:
        got = ckpt.restore((folder / str(step)).absolute(), {"params": params, "opt_state": opt_state})
    return got["params"], got["opt_state"], int(record["next_prompt"])


def cut_metrics(path: Path, step: int) -> None:
    """metrics.jsonl without the lines of steps after `step` (a resumed run writes them again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
