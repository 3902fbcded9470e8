"""A small trained model directory and a `shipyard serve` process around it, for the server tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from data_fixtures import prose, write_jsonl
from model_fixtures import noisy_params, save_run

from shipyard.config import load_config
from shipyard.data.configs import ReadConfig, TokenizeConfig, TokenizerTrainConfig
from shipyard.data.tokenize import run_tokenize
from shipyard.data.tokenizer import load_tokenizer, run_tokenizer_train
from shipyard.model.transformer import logits

VOCAB = 400
CONTEXT = 256


def trained_run(d: Path, steps: int = 120) -> Path:
    """The tiny model fitted for `steps` Adam steps to pseudo-word prose, with a BPE tokenizer carrying
    shipyard's chat tokens: a real (if small) language model whose greedy choices are clear-cut."""

    docs = write_jsonl(d / "docs.jsonl", [prose(s) for s in range(40)])
    run_tokenizer_train([str(docs)], d / "tok", TokenizerTrainConfig(vocab_size=VOCAB), ReadConfig())
    run_tokenize([str(docs)], d / "shards", d / "tok", TokenizeConfig(), ReadConfig(), workers=1)
    cfg = load_config(
        "tiny",
        [f"data.train_tokens={d / 'shards'}", f"model.vocab_size={VOCAB}", f"model.max_seq_len={CONTEXT}"],
    )
    tok = load_tokenizer(d / "tok")
    ids = np.concatenate([tok.encode(prose(s)).ids for s in range(40)]).astype(np.int32)
    params = jax.tree.map(jnp.asarray, noisy_params(cfg.model, key=0, seed=0, scale=0.0))
    opt = optax.adam(3e-3)

    def loss(p, x):
        out = logits(p, x[:, :-1], cfg.model)
        return optax.softmax_cross_entropy_with_integer_labels(out, x[:, 1:]).mean()

    @jax.jit
    def step(p, s, x):
        value, g = jax.value_and_grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state, rng, seq = opt.init(params), np.random.default_rng(0), 65
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq, 16)
        params, state, value = step(params, state, jnp.asarray(np.stack([ids[i : i + seq] for i in starts])))
    assert float(value) < 3.5, f"the fixture model did not learn (loss {float(value):.2f})"
    save_run(d / "run", cfg, jax.tree.map(np.asarray, params))
    return d / "run"


def tool_tuned_run(
    d: Path, base: Path, tok_dir: Path, template: str, tools: list, call: dict, asks: list[str]
) -> Path:
    """`base` (a `trained_run`) fine-tuned to answer each of `asks`, with `tools` offered, by the tool
    call `call` in the Hermes format (`<tool_call>{"name", "arguments"}</tool_call>`), and prose
    questions with the tools offered by prose: a model that calls a tool of its own accord (`tool_choice`
    auto), its conversations rendered by `template` (written into `tok_dir` as its chat template)."""
    from shipyard.run.model_dir import chat_format_of, open_model_dir

    cfg, _, params = open_model_dir(base, "test").load(None, what="test")
    (tok_dir / "chat_template.jinja").write_text(template)
    fmt = chat_format_of(tok_dir, "hf")  # the server's own rendering and tokenization of a conversation
    reply = "<tool_call>" + json.dumps(call) + "</tool_call>"

    def example(content: str, offered: list, answer: str) -> list[int]:
        prompt = fmt.prompt([{"role": "user", "content": content}], tools=offered)
        return prompt + fmt.tok.encode(answer, add_special_tokens=False).ids + [fmt.end_id]

    examples = []
    for offered in (tools, tools[:1]):  # all the tools, or the called one alone
        examples += [example(ask, offered, reply) for ask in asks]
        for s in range(6):  # prose stays prose with the tools offered
            question, answer = " ".join(prose(100 + s).split()[:4]), prose(200 + s)[:60]
            examples.append(example(question, offered, answer))
    width = max(map(len, examples))
    pad = np.zeros((len(examples), width), np.int32)
    mask = np.zeros((len(examples), width - 1), np.float32)
    for i, e in enumerate(examples):
        pad[i, : len(e)] = e
        mask[i, : len(e) - 1] = 1.0
    params = jax.tree.map(jnp.asarray, params)
    opt = optax.adam(3e-3)

    def loss(p, x, m):
        out = logits(p, x[:, :-1], cfg.model)
        return (optax.softmax_cross_entropy_with_integer_labels(out, x[:, 1:]) * m).sum() / m.sum()

    @jax.jit
    def step(p, s, x, m):
        value, g = jax.value_and_grad(loss)(p, x, m)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state, x, m = opt.init(params), jnp.asarray(pad), jnp.asarray(mask)
    for _ in range(150):
        params, state, value = step(params, state, x, m)
    assert float(value) < 0.1, f"the tool-call model did not learn its replies (loss {float(value):.3f})"
    save_run(d / "tool-run", cfg, jax.tree.map(np.asarray, params))
    return d / "tool-run"


def swap_runs(d: Path) -> dict[str, Path]:
    """Run directories for the hot-swap tests, untrained (noisy random weights, clear-cut greedy
    choices) with one BPE tokenizer: "served" and "other" (the same model, other weights),
    "staging" (a third set of weights, to move into "served" as its next checkpoint), "shape" (another
    hidden size) and "tokenizer" (the same shapes with another tokenizer)."""

    def tokenized(name: str, seeds: range) -> Path:
        docs = write_jsonl(d / f"{name}.jsonl", [prose(s) for s in seeds])
        run_tokenizer_train(
            [str(docs)], d / f"{name}-tok", TokenizerTrainConfig(vocab_size=VOCAB), ReadConfig()
        )
        run_tokenize(
            [str(docs)], d / f"{name}-shards", d / f"{name}-tok", TokenizeConfig(), ReadConfig(), workers=1
        )
        return d / f"{name}-shards"

    def config(shards: Path, *more: str):
        return load_config("tiny", [f"data.train_tokens={shards}", f"model.vocab_size={VOCAB}", *more])

    shards, others = tokenized("docs", range(40)), tokenized("other-docs", range(40, 80))
    cfg = config(shards, f"model.max_seq_len={CONTEXT}")
    runs = {}
    for name, seed, c in [
        ("served", 0, cfg),
        ("other", 1, cfg),
        ("staging", 2, cfg),
        ("shape", 0, config(shards, f"model.max_seq_len={CONTEXT}", "model.hidden_size=32")),
        ("tokenizer", 0, config(others, f"model.max_seq_len={CONTEXT}")),
    ]:
        runs[name] = d / name
        save_run(runs[name], c, noisy_params(c.model, key=3, seed=seed, scale=0.2))
    return runs


def slow_run(d: Path, shards: Path) -> Path:
    """A random model of the `small` preset's shape (decode steps of milliseconds, not microseconds) with
    the tokenizer of `shards`: for tests that need a request to still be running when they act on it."""

    # scan_unroll=1: the prefill compiles one layer body, not six unrolled (the CPU decode step, what
    # makes a request last, is unrolled per layer either way)
    cfg = load_config(
        "small", [f"data.train_tokens={shards}", f"model.vocab_size={VOCAB}", "model.scan_unroll=1"]
    )
    save_run(d / "slow", cfg, noisy_params(cfg.model, key=1, seed=1, scale=0.02))
    return d / "slow"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model_dir: Path, log: Path, *flags: str, api_key: str | None = None):
    """A `ServerProcess` for the `with` block (a module fixture's lifetime); it must exit 0 at the end
    (SIGTERM drains, then exits cleanly)."""
    server = ServerProcess(model_dir, *flags, api_key=api_key, log=log)
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, server.log_text()


class ServerProcess:
    """`shipyard serve` in a child process on a free local port; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, model_dir: Path, *flags: str, api_key: str | None = None, log: Path | None = None):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "shipyard.cli",
            "serve",
            str(model_dir),
            "--port",
            str(self.port),
            *flags,
        ]
        if api_key:
            args += ["--api-key", api_key]
        self.log_path = log
        self.log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shipyard serve exited with {self.proc.returncode}: {self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"shipyard serve did not come up in {timeout} s: {self.log_text()}")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5.0).json()

    def log_text(self) -> str:
        return Path(self.log_path).read_text() if self.log_path else ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path:
            self.log.close()
        return self.proc.returncode


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent event stream, '[DONE]' as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
