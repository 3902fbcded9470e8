"""A bf16 train step with pipeline stages compiles and runs on the CPU, its loss close to fp32's.

XLA CPU aborts the whole process (a CHECK, not an exception) compiling a bf16 psum inside a
shard_map manual over only some mesh axes, which is what the transpose of the schedule's whole-given
inputs was (parallel/pipeline.py, `_widen_on_cpu`). So the steps run in a child process: a
regression fails this test instead of killing the test session.
"""

import json
import math
import subprocess
import sys

import pytest

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

CHILD = r"""
import json, sys
import jax
import numpy as np
from shipyard.config import MeshConfig, load_config
from shipyard.data.loader import build_loader
from shipyard.model.params import init_params
from shipyard.parallel.mesh import make_mesh
from shipyard.train.program import build_program
from shipyard.train.step import init_state

B, L = 4, 32
out = {}
for dtype in ("bfloat16", "float32"):
    cfg = load_config("tiny", [
        f"train.global_batch_size={B}", f"data.seq_len={L}", "model.num_layers=2", "model.hidden_size=32",
        "model.intermediate_size=64", "train.microbatches=1", "train.pipeline={microbatches: 2, repeats: 1}",
        f"train.precision.compute_dtype={dtype}",
    ])
    cfg = cfg.model_copy(update={"mesh": MeshConfig(pipeline=2)})
    program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
    params = init_params(program.specs, jax.random.key(0), program.shardings)
    state = init_state(cfg, params, program.optimizer)
    tokens = build_loader([sys.argv[1]], [1.0], 0, B, L, cfg.model.vocab_size).global_batch(0)
    batch = {"tokens": tokens, "loss_mask": np.ones((B, L), np.float32)}
    _, m = program.train_step(state, jax.device_put(batch, program.batch_shardings), None)
    out[dtype] = [float(m["loss"]), float(m["grad_norm"])]
    print(dtype, "ran", flush=True)
print(json.dumps(out))
"""


def test_bf16_pipeline_step_compiles_and_tracks_fp32(byte_tokens):
    """One pipeline=2 train step in bf16 and one in fp32 from the same params and batch (a child
    process): the bf16 one runs, and its loss and grad norm are finite and close to fp32's."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(byte_tokens)], capture_output=True, text=True, timeout=600
    )
    log = "\n".join(line for line in done.stderr.splitlines() if not line.lstrip().startswith("@"))
    assert done.returncode == 0, f"pipeline steps died ({done.returncode}):\n{done.stdout}{log[-3000:]}"
    got = json.loads(done.stdout.strip().splitlines()[-1])
    (loss, norm), (want_loss, want_norm) = got["bfloat16"], got["float32"]
    assert math.isfinite(loss) and math.isfinite(norm)
    # bf16 keeps ~3 significant digits; a fresh model's loss is near log(vocab) either way
    assert loss == pytest.approx(want_loss, rel=1e-3)
    assert norm == pytest.approx(want_norm, rel=2e-2)
