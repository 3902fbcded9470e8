"""`shipyard rl`: the loop. Rollouts from the serving engine, rewards, advantages, optimizer steps,
the new weights swapped into the same engine, held-out evaluation; metrics.jsonl and the final
params as a model directory every other command reads.

    for each step:
        draw N prompts; G replies each (one engine call; a prompt's replies share its prefill;
            with fixed_shape, drawn from the trainer's own program instead: rl/fixed_rollout.py)
        rewards; with dynamic sampling, groups of equal rewards are dropped and new prompts drawn
        advantages per group; `updates_per_batch` optimizer steps on the batch (rl/step.py), of
            what rl.finetune trains, on rl.mesh (rl/placement.py)
        the engine takes the new weights in place (`Engine.swap`: same shapes, nothing recompiles)

OUT holds rl.yaml (the resolved RLConfig) and metrics.jsonl (and the same numbers as TensorBoard
scalars in OUT/tb) from the start (a line per step:
rewards, lengths, dropped groups, clip fraction, KL, entropy, the importance ratio at each batch's
first step, rollout and training seconds; held-out reward, pass@1 and pass@k where evaluated), and
state/ every `save_every` steps (rl/resume.py: the same command resumes a killed run). At the end
it gets params/ (Orbax), the tokenizer files and config.yaml, last: then it is a model directory
as `import hf` writes them, which `generate`, `chat`, `serve`, `eval` and `train.init_from` take.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from shipyard.config import RLConfig, to_yaml
from shipyard.errors import ConfigError, DataError
from shipyard.inference.engine import Engine
from shipyard.output import progress, write_atomic
from shipyard.rl import resume, tasks
from shipyard.rl.fixed_rollout import sample_fixed
from shipyard.rl.loss import group_advantages
from shipyard.rl.placement import placement_for
from shipyard.rl.report import write_rl_report
from shipyard.rl.rollout import Group, build_batch, informative, pass_at, reply_seed, sample_groups
from shipyard.rl.step import build_optimizer, make_distribution, make_update, on_policy_model, sequence_length
from shipyard.train.metrics import MetricsWriter

EVAL_SEED = 0x5EED
"""Mixed into the run's seed for the held-out prompts (a stream of its own)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


class PromptSource:
    """The training prompts, in a fixed order for the run's seed, never one of the held-out prompts:
    a built-in task's items or a prompt file's lines (reshuffled at each pass)."""

    def __init__(self, rl: RLConfig, file_items: list[dict] | None, held_out: set[str]):
        self.rl, self.items, self.held_out = rl, file_items, held_out
        self.next = 0  # items handed out so far (a resumed run starts where the step says)

    def take(self, n: int) -> list[dict]:
        """The next n prompts (handed out: the next call goes on after them)."""
        out, self.next = self.ahead(n)
        return out

    def ahead(self, n: int) -> tuple[list[dict], int]:
        """(the next n prompts, the index after them), without handing them out."""
        out, index = [], self.next
        while len(out) < n:
            item = self._item(index)
            index += 1
            if tasks.prompt_key(item) not in self.held_out:
                out.append(item)
        return out, index

    def _item(self, index: int) -> dict:
        if self.items is None:
            return tasks.task_item(self.rl.task, self.rl.seed, index, self.rl.digits)
        rounds, at = divmod(index, len(self.items))
        order = np.random.default_rng([self.rl.seed, rounds]).permutation(len(self.items))
        return self.items[int(order[at])]


def _held_out(rl: RLConfig, file_items: list[dict] | None) -> list[dict]:
    """The held-out prompts: a task's own stream, or the last eval_prompts lines of a prompt file."""
    if rl.eval_prompts == 0:
        return []
    if file_items is None:
        seen, out, i = set(), [], 0
        while len(out) < rl.eval_prompts and i < 100 * rl.eval_prompts:
            item = tasks.task_item(rl.task, rl.seed ^ EVAL_SEED, i, rl.digits)
            i += 1
            if item["prompt"] not in seen:
                seen.add(item["prompt"])
                out.append(item)
        return out
    if len(file_items) <= rl.eval_prompts:
        raise DataError(
            f"rl: {rl.prompts} holds {len(file_items)} prompts; eval_prompts={rl.eval_prompts} would leave none "
            "to train on (lower eval_prompts, or 0)"
        )
    return file_items[-rl.eval_prompts :]


def run_rl(
    model: str,
    out: str | Path,
    rl: RLConfig,
    *,
    checkpoint: int | None = None,
    tokenizer: str | None = None,
    say=print,
) -> dict:
    """Train the model directory `model` (step `checkpoint` of a run, default its newest) with RL into
    the new directory `out`; returns the last step's metrics (and the held-out ones)."""
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.run.model_dir import open_model_dir

    out = Path(out)
    resuming = resume.resumable(out, rl)  # (before anything slow: a mistyped OUT is one line)
    model_dir = open_model_dir(model, "rl", tokenizer)
    tok_dir = model_dir.require_tokenizer("rl")
    tok = load_tokenizer(tok_dir)
    eos = special_token_ids(tok_dir, tok)["eos_token"]
    if rl.prompts is not None:
        file_items = tasks.load_prompts(rl.prompts)
        reward = tasks.Rewarder(tasks.load_reward(rl.reward), rl.reward_timeout, say)
    else:
        file_items, reward = None, tasks.Rewarder(tasks.checker(rl.task))
    held_out = _held_out(rl, file_items)
    source = PromptSource(rl, file_items, {tasks.prompt_key(item) for item in held_out})
    encode, decode, stop_ids = _codec(model_dir, file_items, tok, eos)

    cfg, _, params = model_dir.load(checkpoint, what="rl")
    params = jax.tree.map(jnp.asarray, params)
    longest = max(len(encode(item)) for item in [*held_out, *source.ahead(256)[0]])
    model, length, place, trainable, frozen = _place(rl, cfg.model, params, longest)
    del params  # (full training: `trainable` is it; otherwise `frozen` holds what the adapters go on)
    engine = _engine(rl, model, length, place.engine_params(trainable, frozen))
    learn, opt_state = _trainer(rl, model, length, place, trainable, frozen, engine)
    groups_of = _sampler(rl, model, engine, place, frozen, encode, decode, stop_ids, reward, length, longest)
    evaluate = partial(_evaluate, rl, held_out, groups_of)

    saved = resume.complete_steps(out) if resuming else []
    start = saved[0] if saved else 0
    if start:
        trainable, opt_state, source.next = resume.restore(out, start, trainable, opt_state)
        engine.swap(place.engine_params(trainable, frozen))
        say(f"rl: resuming {out} after step {start}")
    if not resuming:
        out.mkdir(parents=True)
        (out / "rl.yaml").write_text(yaml.safe_dump(rl.model_dump(mode="json"), sort_keys=False))
    resume.cut_metrics(out / "metrics.jsonl", start if start else -1)  # (no state yet: from step 0 again)
    last, trainable = _loop(
        out, rl, start, source, groups_of, evaluate, learn, trainable, opt_state, reward, say
    )
    write_rl_report(out)
    _save(out, place.engine_params(trainable, frozen), model_dir, tok_dir)
    say(f"rl: wrote {out} (step {rl.steps}: {_show(last)}; report.md, plots/rl.png)")
    return last


def _codec(
    model_dir, file_items: list[dict] | None, tok, eos: int
) -> tuple[Callable, Callable, tuple[int, ...]]:
    """(encode: a prompt item's token ids, decode: token ids' text, the ids that end a reply). A chat
    item (`messages`, no `prompt`) is rendered with the model's own chat template, whose end-of-turn
    ids then end a reply as EOS does."""
    chat = None
    if file_items is not None and any("prompt" not in item for item in file_items):
        chat = model_dir.chat_format(what="rl")  # chats are rendered with the model's own template
    stop_ids = (eos,) if chat is None else tuple(dict.fromkeys((*chat.end_ids, eos)))

    def encode(item: dict) -> tuple[int, ...]:
        if "prompt" not in item:
            return tuple(chat.prompt(item["messages"]))
        return tuple(tok.encode(item["prompt"], add_special_tokens=False).ids) or (eos,)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    return encode, decode, stop_ids


def _place(rl: RLConfig, model_cfg, params, longest: int) -> tuple:
    """Size the run for prompts of up to `longest` tokens and place it on rl.mesh (rl/placement.py):
    (the on-policy model config, its length: prompt + reply, the placement, the trainable part, the
    frozen rest)."""
    length = sequence_length(longest, rl.max_tokens)
    if length > model_cfg.max_seq_len:
        raise ConfigError(
            f"rl: prompts of {longest} tokens + max_tokens {rl.max_tokens} exceed the model's context "
            f"{model_cfg.max_seq_len}; lower max_tokens"
        )
    model = on_policy_model(model_cfg, length)  # the trainer's and the engine's (OUT keeps cfg.model)
    place = placement_for(model, rl, length)
    partition = place.partition
    trainable, frozen = place.put(
        partition.initial(params, jax.random.key(rl.seed)), partition.frozen(params)
    )
    return model, length, place, trainable, frozen


def _engine(rl: RLConfig, model, length: int, params) -> Engine:
    """The serving engine the rollouts run on: `length` slots a row, log-probs of the sampling
    distribution, rows laid out and compiled as the trainer's (`Engine(training_numerics=True)`)."""
    return Engine(
        params,
        model,
        max_batch=rl.max_batch,
        max_len=length,
        sampling_logprobs=True,
        share_prefill=rl.shared_prefill,
        training_numerics=True,
    )


def _sampler(rl: RLConfig, model, engine, place, frozen, encode, decode, stop_ids, reward, length, longest):
    """The run's `groups_of(items, step, replies, temperature, stream=0, train=False, trainable=None)`:
    the items' prompts, `replies` rewarded replies each (seeded by step, item, reply and `stream`),
    drawn by `engine`; with rl.fixed_shape, a training step's by the trainer's own program on
    `trainable` (rl/fixed_rollout.py)."""
    distribution = make_distribution(model, rl, place.partition, place.layout) if rl.fixed_shape else None
    rows = rl.prompts_per_step * rl.group_size

    def groups_of(
        items,
        step: int,
        replies: int,
        temperature: float,
        stream: int = 0,
        train: bool = False,
        trainable=None,
    ) -> list[Group]:
        prompts = []
        for item in items:
            ids = encode(item)
            if len(ids) + rl.max_tokens > length:
                raise DataError(
                    f"rl: the prompt {tasks.prompt_text(item)[:40]!r} is {len(ids)} tokens: longer than the "
                    f"{length - rl.max_tokens} the run sized its engine for (prompts of up to {longest} seen)"
                )
            prompts.append(ids)
        how = dict(
            rl=rl,
            replies=replies,
            seeds=lambda i, g: reply_seed(rl.seed, step, i, g, stream=stream),
            stop_ids=stop_ids,
            decode=decode,
            reward=reward,
        )
        if train and distribution is not None:  # fixed-shape mode: the trainer's own program draws
            bound = lambda tokens: distribution(trainable, frozen, place.put_batch(tokens))  # noqa: E731
            return sample_fixed(bound, items, prompts, rows=rows, length=length, **how)
        return sample_groups(engine, items, prompts, temperature=temperature, **how)

    return groups_of


def _trainer(rl: RLConfig, model, length: int, place, trainable, frozen, engine) -> tuple[Callable, object]:
    """(learn, the optimizer's starting state): `learn(groups, trainable, opt_state)` is `_learn` with
    the run's optimizer update and KL reference."""
    optimizer = build_optimizer(rl)
    opt_state = optimizer.init(trainable)
    update = make_update(model, rl, optimizer, place.partition, place.layout)
    # the KL's reference: the starting trainable part (with LoRA: the starting adapters, whose B = 0
    # leaves the frozen model exactly as it was)
    reference = jax.tree.map(jnp.copy, trainable) if rl.beta else None
    learn = partial(
        _learn,
        rl=rl,
        update=update,
        place=place,
        frozen=frozen,
        reference=reference,
        length=length,
        engine=engine,
    )
    return learn, opt_state


def _evaluate(rl: RLConfig, held_out: list[dict], groups_of: Callable, step: int) -> dict:
    """The held-out metrics at `step`: greedy reward and pass@1, sampled pass@k ({}: no held-out prompts)."""
    if not held_out:
        return {}
    greedy = groups_of(held_out, step, 1, 0.0, stream=1)
    sampled = groups_of(held_out, step, rl.pass_k, rl.temperature, stream=2)
    rewards = np.array([g.replies[0].reward for g in greedy])
    return {
        "eval_reward": float(rewards.mean()),
        "eval_pass@1": pass_at(greedy),
        f"eval_pass@{rl.pass_k}": pass_at(sampled),
    }


def _learn(groups, trainable, opt_state, *, rl: RLConfig, update, place, frozen, reference, length, engine):
    """`RLConfig.updates_per_batch` optimizer steps on the batch of `groups` (advantages per group), then the
    engine takes the new weights: (trainable, opt_state, the updates' metrics)."""
    rows = rl.prompts_per_step * rl.group_size
    metrics: dict = {}
    rewards = np.stack([g.rewards() for g in groups])
    adv = np.asarray(group_advantages(jnp.asarray(rewards), rl.advantage))
    batch = place.put_batch(build_batch(groups, adv, rows, length, rl))
    for u in range(rl.updates_per_batch):
        trainable, opt_state, m = update(trainable, opt_state, batch, frozen, reference)
        if u == 0:  # the batch's first step: the policy is the sampler, ratio 1
            metrics = {f"first_{k}": float(v) for k, v in m.items() if k.startswith(("ratio", "kl_rollout"))}
        metrics.update({k: float(v) for k, v in m.items()})
    engine.swap(place.engine_params(trainable, frozen))
    return trainable, opt_state, metrics


def _loop(
    out: Path, rl: RLConfig, start: int, source, groups_of, evaluate, learn, trainable, opt_state, reward, say
):
    """The steps after `start` (0: a first evaluation) up to rl.steps: rollouts, `learn`, metrics to
    OUT/metrics.jsonl and OUT/tb, held-out evaluation and saved state at their intervals. Returns
    (the last step's metrics, the trained part)."""
    last: dict = {}
    # metrics.jsonl and TensorBoard (OUT/tb: a resumed run hides the events after its saved step)
    writer = MetricsWriter(out / "metrics.jsonl", out / "tb", purge_step=start + 1 if start else 0)
    with contextlib.closing(writer) as log:
        if start == 0:
            first_eval = evaluate(0)
            log.write({"step": 0, **first_eval})
            say(f"rl: held-out before training: {_show(first_eval)}")
        bar = progress(range(start + 1, rl.steps + 1), desc="rl", unit="step", initial=start, total=rl.steps)
        for step in bar:
            t0 = time.perf_counter()
            # (fixed-shape rollouts draw from the trainable part as it is at this step)
            groups, sampled, refills = _draw(rl, source, step, partial(groups_of, trainable=trainable))
            rollout_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            metrics: dict = {}
            if groups:
                trainable, opt_state, metrics = learn(groups, trainable, opt_state)
            train_s = time.perf_counter() - t1
            last = _step_metrics(step, sampled, groups, refills, metrics, rollout_s, train_s, reward)
            if step % rl.eval_every == 0 or step == rl.steps:
                last.update(evaluate(step))
            log.write(last)
            if step % rl.save_every == 0 or step == rl.steps:
                resume.save(out, step, trainable, opt_state, source.next)
            bar.set_postfix(reward=f"{last['reward_mean']:.3f}")
    return last, trainable


def _step_metrics(step, sampled, groups, refills, metrics, rollout_s, train_s, reward) -> dict:
    """A step's metrics line (the rewards of every reply sampled, the updates' `metrics`)."""
    every = [r for g in sampled for r in g.replies]
    values = np.array([r.reward for r in every])
    return {
        "step": step,
        "reward_mean": float(values.mean()),
        "reward_min": float(values.min()),
        "reward_max": float(values.max()),
        "reply_tokens": float(np.mean([len(r.tokens) for r in every])),
        "overlong_fraction": float(np.mean([r.overlong for r in every])),
        "groups_trained": len(groups),
        "dropped_fraction": 1.0 - len(groups) / max(len(sampled), 1),
        "refills": refills,
        **metrics,
        "rollout_seconds": rollout_s,
        "train_seconds": train_s,
        "rollout_share": rollout_s / max(rollout_s + train_s, 1e-9),
        "reward_failures": dict(reward.failures),
    }


def _draw(rl: RLConfig, source: PromptSource, step: int, groups_of: Callable) -> tuple[list, list, int]:
    """(groups to train on, every group sampled, refill rounds) of one step: N prompts, then with
    dynamic sampling new prompts for the groups of equal rewards, up to max_refills rounds."""
    sampled = groups_of(source.take(rl.prompts_per_step), step, rl.group_size, rl.temperature, train=True)
    keep = [g for g in sampled if informative(g)] if rl.dynamic_sampling else list(sampled)
    rounds = 0
    while rl.dynamic_sampling and len(keep) < rl.prompts_per_step and rounds < rl.max_refills:
        rounds += 1
        more = groups_of(
            source.take(rl.prompts_per_step - len(keep)),
            step,
            rl.group_size,
            rl.temperature,
            100 + rounds,
            train=True,
        )
        sampled += more
        keep += [g for g in more if informative(g)]
    return keep[: rl.prompts_per_step], sampled, rounds


def _show(metrics: dict) -> str:
    keys = ("reward_mean", "eval_reward", "eval_pass@1")
    return ", ".join(f"{k} {metrics[k]:.3f}" for k in keys if k in metrics) or "no held-out prompts"


def _save(out: Path, params, model_dir, tok_dir: Path) -> None:
    """params/ (Orbax), the tokenizer files, then config.yaml, last and atomically: OUT becomes an
    `import hf`-shaped model directory only once everything else is in place."""
    import orbax.checkpoint as ocp

    shutil.rmtree(out / "params", ignore_errors=True)  # a killed run's partial copy
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((out / "params").absolute(), params)
    tok_dir = Path(tok_dir)
    src = tok_dir if tok_dir.is_dir() else tok_dir.parent
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    cfg = model_dir.config
    # the merged, full params: no adapters to apply, and training from here starts from them
    train = cfg.train.model_copy(update={"finetune": None, "init_from": str((out / "params").absolute())})
    header = f"# trained with shipyard rl from {model_dir.path}\n"
    write_atomic(out / "config.yaml", header + to_yaml(cfg.model_copy(update={"train": train})))
