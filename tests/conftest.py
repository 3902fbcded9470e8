"""Test setup: 8 host CPU devices for sharding tests, set before JAX starts."""

import os
import tempfile

# sha256 verdicts of shards and checkpoints are cached per user (data/hashcache.py): keep the suite's
# out of the developer's ~/.cache, and every session's apart (subprocesses inherit it).
# Under pytest-xdist the workers inherit the controller's directory, so they share one cache too.
if "SHIPYARD_TEST_CACHE" not in os.environ:
    os.environ["SHIPYARD_TEST_CACHE"] = tempfile.mkdtemp(prefix="shipyard-tests-cache-")
os.environ["XDG_CACHE_HOME"] = os.environ["SHIPYARD_TEST_CACHE"]

# Compiled programs are shared by the whole session, the CLI subprocesses included (they inherit the
# environment): most tests train, serve or export the same `tiny` model, and on CPU compiling it
# costs more than running it. XLA flags and devices are part of the cache key, so a test with
# other flags compiles its own. One directory per session unless SHIPYARD_TEST_CACHE names one
# (.ci/run shares one between the default and the slow tier of the same checkout).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["XDG_CACHE_HOME"], "xla"))
# Every program, however quick to compile (as `shipyard serve` does): a CLI run forked or started by a
# test compiles a dozen small programs under 0.2 s each, and from the cache a 6-step `tiny` run takes
# 3.3 s instead of 3.5-3.8 s (the checkpoint chaos tests start one or two per boundary of a save).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()

from shipyard import cpu_tuning  # noqa: E402

cpu_tuning.apply_xla_flags()
cpu_tuning.pin_cpu_platform()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# s3_server / s3_env / bucket: a real S3-protocol server (moto) on 127.0.0.1, started on first use
pytest_plugins = ("s3_fixtures", "xdist_schedule", "cpu_log")


@pytest.fixture(scope="session")
def byte_tokens(tmp_path_factory):
    """~400 KB of real text (stdlib source) as byte tokens, written once per session."""
    from shipyard.data.bytecorpus import write_byte_tokens

    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    write_byte_tokens(path, split="train", max_bytes=400_000)
    return path


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
