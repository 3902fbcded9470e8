"""The CPU-only tricks apply on the CPU alone: the dense backward, unrolled layer scans, XLA CPU flags
and the allocator re-exec; a GPU/TPU process gets the plain model and no flags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shipyard import cpu_tuning
from shipyard.config import load_config
from shipyard.model import layers, transformer
from shipyard.model.params import abstract_params


def _grad_jaxpr(x, w) -> str:
    return str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(layers.dense(x, w) ** 2), (0, 1)))(x, w))


def test_dense_uses_the_cpu_backward_on_cpu_only(monkeypatch):
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    assert layers.cpu_backend()  # the test machine
    cpu = _grad_jaxpr(x, w)
    assert "optimization_barrier" in cpu  # the CPU backward (layers._dense)
    want = jax.grad(lambda x, w: jnp.sum(layers.dense(x, w) ** 2), (0, 1))(x, w)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not layers.cpu_backend()
    plain = _grad_jaxpr(x, w)
    assert "optimization_barrier" not in plain
    got = jax.grad(lambda x, w: jnp.sum(layers.dense(x, w) ** 2), (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _scan_unrolls(cfg) -> list[int]:
    params = abstract_params(transformer.param_specs(cfg.model))
    tokens = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: transformer.forward(p, tokens, cfg.model)[0])(params)
    return [e.params["unroll"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


def test_scan_unroll_applies_on_cpu_only(monkeypatch):
    cfg = load_config("tiny", ["model.num_layers=3", "model.scan_unroll=2"])
    assert _scan_unrolls(cfg) == [2]
    assert layers.layer_unroll(8, 3) == 3  # at most the layer count
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert _scan_unrolls(cfg) == [1]


@pytest.mark.parametrize(
    ("platforms", "cpu"),
    [
        ("cpu", True),
        ("cuda", False),
        ("tpu", False),
        ("cuda,cpu", False),
        ("cpu,cuda", True),
        (" CPU ", True),
    ],
)
def test_jax_platforms_decides_when_set(platforms, cpu, monkeypatch):
    # An installed, present accelerator does not matter once JAX_PLATFORMS says.
    monkeypatch.setattr(cpu_tuning, "_installed", lambda module: True)
    monkeypatch.setattr(cpu_tuning, "_present", lambda patterns: True)
    assert cpu_tuning.will_run_on_cpu({"JAX_PLATFORMS": platforms}) is cpu


def test_an_installed_plugin_counts_only_with_its_hardware(monkeypatch):
    assert cpu_tuning.will_run_on_cpu({})  # this machine: no accelerator plugin
    monkeypatch.setattr(cpu_tuning, "_installed", lambda module: module == "jax_cuda12_plugin")
    monkeypatch.setattr(cpu_tuning, "_present", lambda patterns: False)
    assert cpu_tuning.will_run_on_cpu({})  # a CUDA wheel on a machine without a GPU: JAX falls back to CPU
    monkeypatch.setattr(cpu_tuning, "_present", lambda patterns: "/dev/nvidiactl" in patterns)
    assert not cpu_tuning.will_run_on_cpu({})
    monkeypatch.setattr(cpu_tuning, "_installed", lambda module: module == "libtpu")
    monkeypatch.setattr(cpu_tuning, "_present", lambda patterns: any("accel" in p for p in patterns))
    assert not cpu_tuning.will_run_on_cpu({})


def test_xla_flags_only_for_a_cpu_process():
    env = {"JAX_PLATFORMS": "cuda"}
    cpu_tuning.apply_xla_flags(env)
    assert "XLA_FLAGS" not in env
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    cpu_tuning.apply_xla_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {cpu_tuning.CPU_XLA_FLAGS}"


@pytest.mark.parametrize(("platforms", "reexec"), [("cpu", True), ("cuda", False)])
def test_allocator_reexec_only_for_a_cpu_process(platforms, reexec, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_tuning.os, "execve", lambda path, argv, env: calls.append(env))
    for name in ("LD_PRELOAD", "GLIBC_TUNABLES", "SHIPYARD_NO_REEXEC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    cpu_tuning.reexec_with_fast_allocator()
    assert len(calls) == int(reexec)
    if reexec:
        assert calls[0]["GLIBC_TUNABLES"] == cpu_tuning.GLIBC_HUGEPAGES
