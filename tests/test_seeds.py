"""data.seed: the data order has its own seed; left null, the order is train.seed's, as before it existed;
and --resume refuses what would change the data order (the CLI cases are in tests/test_resume.py).

Built from the trainer's own pieces (load_data, build_program, initial_state),
so what is compared is what a run would train on and start from; no step runs.
"""

import json

import grain
import jax
import numpy as np
import pytest

from shipyard.config import load_config, to_yaml
from shipyard.errors import RunDirError
from shipyard.output import write_atomic
from shipyard.run.rundir import check_resumable
from shipyard.train.program import build_program
from shipyard.train.trainer import initial_state, load_data

STEPS = 3


def _start(tokens, tmp_path, *overrides, params=True):
    """(batches of steps 0..STEPS-1, initial params or None) of a `tiny` run on `tokens`."""
    cfg = load_config("tiny", [f"data.train_tokens={tokens}", *overrides])
    data = load_data(cfg, print)
    batches = [data.loader.global_batch(s) for s in range(STEPS)]
    if not params:  # the init costs seconds (it compiles): only where it is compared
        return batches, None
    _, state, _ = initial_state(build_program(cfg, eos_id=data.eos_id), tmp_path, False, True, print)
    return batches, [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_data_seed_reshuffles_the_data_but_not_the_init(byte_tokens, tmp_path):
    base_batches, base_params = _start(byte_tokens, tmp_path)
    batches, params = _start(byte_tokens, tmp_path, "data.seed=1")
    assert _same(params, base_params), "data.seed changed the initialisation"
    assert not any(np.array_equal(a, b) for a, b in zip(batches, base_batches)), "data.seed kept the order"
    # train.seed with data.seed pinned to the old order: the data stays
    batches, _ = _start(byte_tokens, tmp_path, "train.seed=1", "data.seed=0", params=False)
    assert _same(batches, base_batches)


def test_default_data_order_is_the_train_seed_order(byte_tokens, tmp_path):
    """With data.seed null a run reads what it read before data.seed existed: rebuilt here from the
    token file and Grain's index shuffle keyed by train.seed the way the loader always keyed it."""
    seed = 3
    batches, _ = _start(byte_tokens, tmp_path, f"train.seed={seed}", params=False)
    cfg = load_config("tiny")
    tokens, length, size = np.load(byte_tokens), cfg.data.seq_len, cfg.train.global_batch_size
    n = (tokens.size - 1) // length
    # the loader's per-source shuffle seed for the first source (data/loader.py: _set_seed(seed, 0))
    order = grain.MapDataset.source(np.arange(n)).shuffle(seed=(seed * 1_000_003 + 1) % (2**31 - 1))
    for s, batch in enumerate(batches):
        rows = [int(order[s * size + r]) for r in range(size)]
        want = np.stack([tokens[i * length : i * length + length + 1] for i in rows]).astype(np.int32)
        assert np.array_equal(batch, want), f"step {s}: the default data order changed"


def _saved_run(run_dir, cfg, inputs):
    """A run directory's header as a run of `cfg` on `inputs` writes it (no checkpoints needed to check)."""
    run_dir.mkdir()
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    if inputs is not None:
        write_atomic(run_dir / "provenance.json", json.dumps({"inputs": inputs}))


def test_resume_checks_mixture_weights_and_falls_back_to_paths(tmp_path):
    """The checks the CLI test cannot reach cheaply: mixture weights, and a run whose provenance.json
    does not record its data (then the paths must match)."""
    mix = "data.mixture=[{path: a.npy, weight: 1}, {path: b.npy, weight: 3}]"
    cfg = load_config("tiny", [mix])
    inputs = {
        "mixture[0]": {"path": "a.npy", "sha256": "aa"},
        "mixture[1]": {"path": "b.npy", "sha256": "bb"},
    }
    _saved_run(tmp_path / "m", cfg, inputs)
    check_resumable(tmp_path / "m", cfg, inputs)  # the same run: accepted
    heavier = load_config("tiny", [mix.replace("weight: 3", "weight: 4")])
    with pytest.raises(
        RunDirError, match=r"data.mixture weights: \[1.0, 3.0\], this config has \[1.0, 4.0\]"
    ):
        check_resumable(tmp_path / "m", heavier, inputs)
    with pytest.raises(RunDirError, match=r"mixture\[1\] \(b.npy\) is not the data"):
        check_resumable(tmp_path / "m", cfg, {**inputs, "mixture[1]": {"path": "b.npy", "sha256": "cc"}})
    _saved_run(tmp_path / "p", cfg, None)
    check_resumable(tmp_path / "p", cfg, inputs)
    moved = load_config("tiny", [mix.replace("b.npy", "c.npy")])
    with pytest.raises(RunDirError, match="provenance.json does not record the run's data"):
        check_resumable(tmp_path / "p", moved, inputs)
