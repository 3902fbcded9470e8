"""Verifiable tasks and rewards for RL: built-in tasks generated locally, each with an exact checker;
a prompt file (JSONL); a user's reward function.

A built-in task item is {"prompt": "12+345=", "answer": "357"}; the reply is right when its first
line (up to a newline or the end) is the answer, with surrounding spaces ignored. Items are a pure
function of (task, seed, index), so a resumed run, or the held-out set, draws the same ones.

    add       a+b=           two numbers of 1..`digits` digits
    multiply  a*b=           a number of 1..`digits` digits times one of 1..2
    reverse   reverse abc=   letters reversed
    sort      sort cab=      letters in order
    code      a Python expression for f(x) = a x + b described in words, run in a sandbox on 5 inputs

A user reward is `module:function` or `path/to/file.py:function`, called as function(prompt,
completion, metadata) -> float. An exception it raises, or a call past the run's `reward_timeout`, is
reward 0 and a counted reason (its type, or 'timeout'), never a crashed run.
"""

from __future__ import annotations

import importlib
import inspect
import json
import signal
import string
import threading
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shipyard.data.chat_format import check_messages, read_jsonl_records
from shipyard.errors import ConfigError, DataError

TASKS = ("add", "multiply", "reverse", "sort", "code")


def task_item(task: str, seed: int, index: int, digits: int = 3) -> dict:
    """Item `index` of built-in `task` for `seed`: {"prompt", "answer"}."""
    rng = np.random.default_rng([seed, index, TASKS.index(task)])

    def number(most: int) -> int:
        n = int(rng.integers(1, most + 1))
        return int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10**n))

    if task == "add":
        a, b = number(digits), number(digits)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    if task == "multiply":
        a, b = number(digits), number(2)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}
    letters = "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(2, 2 + digits))))
    if task == "reverse":
        return {"prompt": f"reverse {letters}=", "answer": letters[::-1]}
    if task == "sort":
        return {"prompt": f"sort {letters}=", "answer": "".join(sorted(letters))}
    if task == "code":
        a, b = int(rng.integers(1, digits + 4)), int(rng.integers(0, 10))
        prompt = f"# f(x) returns x times {a} plus {b}\ndef f(x):\n    return "
        tests = [[x, a * x + b] for x in (0, 1, 2, 7, -3)]
        return {"prompt": prompt, "answer": f"x * {a} + {b}", "tests": tests}
    raise ConfigError(f"rl: task {task!r} is not a built-in task; choose one of {', '.join(TASKS)}")


def first_line(completion: str) -> str:
    """The reply's answer: its first line, spaces stripped."""
    return completion.split("\n", 1)[0].strip()


def exact_answer(prompt: str, completion: str, metadata: dict) -> float:
    """The built-in tasks' checker: 1.0 when the reply's first line is metadata["answer"], else 0.0."""
    return 1.0 if first_line(completion) == str(metadata["answer"]) else 0.0


def code_answer(prompt: str, completion: str, metadata: dict) -> float:
    """The code task's checker: the reply's first line as the body of `return` in `def f(x)`, run in
    the sandbox (rl/sandbox.py) on metadata["tests"]; 1.0 when every test passes. A reply that runs
    past the time or memory limit raises (the Rewarder counts it by reason)."""
    from shipyard.rl.sandbox import run_python

    source = (
        f"def f(x):\n    return {first_line(completion)}\n"
        f"print(all(f(a) == b for a, b in {metadata['tests']!r}))\n"
    )
    return 1.0 if run_python(source).stdout.strip() == "True" else 0.0


def checker(task: str) -> Callable[[str, str, dict], float]:
    """The reward function of built-in `task`."""
    return code_answer if task == "code" else exact_answer


def load_reward(spec: str) -> Callable[[str, str, dict], float]:
    """The user's reward function named by `spec` ("module:function" or "file.py:function"),
    checked to take (prompt, completion, metadata); ConfigError in one line otherwise."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"rl: --reward {spec!r} must be module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"rl: --reward file {where} does not exist")
            # compiled and run by hand: an import would leave a __pycache__ beside the user's file
            module = types.ModuleType(f"shipyard_reward_{path.stem}")
            module.__file__ = str(path)
            exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: say so in one line
        raise ConfigError(f"rl: --reward {spec}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl: --reward {spec}: {where} has no function {name!r}")
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError:
        raise ConfigError(
            f"rl: --reward {spec}: {name}{inspect.signature(fn)} must take (prompt, completion, metadata)"
        ) from None
    return fn


class RewardTimeout(BaseException):
    """A reward call ran past its time limit (a BaseException: a user's `except Exception` cannot
    swallow it)."""


def _limited(fn: Callable, seconds: float | None, *args):
    """fn(*args), stopped by SIGALRM after `seconds` (the main thread only: signals are delivered
    there; elsewhere, or with None, unlimited)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        return fn(*args)

    def stop(signum, frame):
        raise RewardTimeout

    before = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


class Rewarder:
    """Calls a reward function on replies; an exception, a non-number or a call past `timeout`
    seconds is reward 0, counted by reason (the first timeout also said in one line)."""

    def __init__(
        self, fn: Callable[[str, str, dict], float], timeout: float | None = None, say: Callable = print
    ):
        self.fn, self.timeout, self.say = fn, timeout, say
        self.failures: Counter[str] = Counter()
        """Replies whose reward call failed, by reason (the exception's type, 'timeout' or 'not a
        finite number')."""

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        try:
            value = float(_limited(self.fn, self.timeout, prompt, completion, metadata))
        except RewardTimeout:
            if not self.failures["timeout"]:
                self.say(
                    f"rl: the reward function ran past reward_timeout={self.timeout:g} s on a reply; such "
                    "replies get reward 0 (counted as 'timeout' in reward_failures)"
                )
            self.failures["timeout"] += 1
            return 0.0
        except Exception as e:  # a user's function must not end the run: reward 0, counted
            self.failures[type(e).__name__] += 1
            return 0.0
        if not np.isfinite(value):
            self.failures["not a finite number"] += 1
            return 0.0
        return value


def prompt_text(item: dict) -> str:
    """What a reward function gets as the prompt: the item's "prompt", or its chat's last message."""
    if "prompt" in item:
        return item["prompt"]
    return str(item["messages"][-1].get("content", ""))


def prompt_key(item: dict) -> str:
    """The identity of an item's prompt (held-out prompts are never trained on)."""
    return item["prompt"] if "prompt" in item else json.dumps(item["messages"], sort_keys=True)


def _prompt_item(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a {type(record).__name__}, expected an object with 'prompt' or 'messages'")
    if isinstance(record.get("prompt"), str):
        return record
    if "messages" not in record:
        raise DataError(f"{where}: needs 'prompt' (a string) or 'messages' (a chat)")
    check_messages(record["messages"], where)
    return record


def load_prompts(path: str | Path) -> list[dict]:
    """Items of a JSONL prompt file: each line an object with "prompt" (a string) or "messages" (a
    chat), and any fields the reward reads; DataError naming the line otherwise."""
    return read_jsonl_records(
        path, "rl", '{"prompt": ...} or {"messages": [...]} objects', _prompt_item, "prompts"
    )
