"""`shipyard rl` (src/shipyard/rl/): rollouts from the serving engine are on-policy for the trainer by
construction (the same sampling transform on both sides), a short run writes its metrics and a model
directory, and the built-in tasks, prompt files and reward functions behave as documented."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_fixtures import trained_run

from shipyard.cli.main import main
from shipyard.config import build_rl_config
from shipyard.errors import ConfigError, DataError
from shipyard.rl import tasks

WORDS = ["the", "a small", "we saw", "she went", "in the", "it is", "one day", "they", "there", "and then"]
REWARD = (
    "def score(prompt, completion, metadata):\n    return completion.count('e') / max(len(completion), 1)\n"
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("rl"))


@pytest.fixture(scope="module")
def model(run_dir):
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.run.model_dir import open_model_dir

    md = open_model_dir(run_dir, "test")
    cfg, _, params = md.load()
    return cfg.model, jax.tree.map(jnp.asarray, params), load_tokenizer(md.require_tokenizer("test"))


def _rollout_vs_trainer(model, rl, sampling_logprobs: bool, length: int = 48) -> float:
    """The largest |rollout log-prob - trainer log-prob| over 4 prompts x 4 replies, the engine and
    the trainer set up as `shipyard rl` sets them (`on_policy_model`, `Engine(training_numerics)`).
    With `length` 200 two of the prompts are about 40 and 70 tokens, prefilled in pieces of 32 (the
    prefill's other path), and attention runs over several key blocks (model.attention.KEY_BLOCK);
    there the reference attention core (`cfg` as it is) is off by ~2e-6, and so are left-padded
    rows (`training_numerics=False`)."""
    from data_fixtures import prose

    from shipyard.inference.engine import Engine
    from shipyard.rl.rollout import build_batch, sample_groups
    from shipyard.rl.step import make_logps, on_policy_model

    cfg, params, tok = model
    cfg = on_policy_model(cfg, length)
    engine = Engine(
        params, cfg, max_batch=16, max_len=length, sampling_logprobs=sampling_logprobs,
        training_numerics=True, prefill_chunk=32,
    )  # fmt: skip
    items = [{"prompt": w} for w in WORDS[:4]]
    if length > 48:
        items[2:] = [{"prompt": " ".join(prose(s).split()[:n])} for s, n in ((1, 25), (2, 45))]
    prompts = [tuple(tok.encode(i["prompt"], add_special_tokens=False).ids) for i in items]
    assert length > 48 or max(map(len, prompts)) < 32
    assert length == 48 or (32 < len(prompts[2]) < 64 < len(prompts[3]) < length - rl.max_tokens)
    groups = sample_groups(
        engine, items, prompts, rl=rl, replies=4, temperature=rl.temperature,
        seeds=lambda i, g: 7 * i + g, stop_ids=(0,), decode=tok.decode, reward=lambda *_: 0.0,
    )  # fmt: skip
    batch = build_batch(groups, np.zeros((4, 4)), 16, length, rl)
    mask = batch["mask"] > 0
    assert mask.sum() == 16 * rl.max_tokens  # every reply ran to max_tokens and is compared
    trainer = np.asarray(make_logps(cfg, rl)(params, jnp.asarray(batch["tokens"])))
    return float(np.abs(trainer[mask] - batch["old_logp"][mask]).max())


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature, top_k, top_p, length", [(1.0, 0, 1.0, 48), (0.9, 20, 0.9, 200), (0.7, 5, 1.0, 48)]
)
def test_rollout_log_probs_are_the_trainer_s_bit_for_bit_and_not_without_the_shared_transform(
    model, temperature, top_k, top_p, length
):
    """Every reply token's log-prob from the engine (prefill, then one cached step per token) is
    bitwise the trainer's full forward of the same tokens, in rows laid out otherwise (the trainer's
    batch holds every group; the engine's rows and cache spans change as replies grow); the engine
    reporting its model's own log-probs instead (the transform applied on one side only) is off by
    far more wherever the transform does anything."""
    rl = build_rl_config(
        ["max_tokens=12", f"temperature={temperature}", f"top_k={top_k}", f"top_p={top_p}", "overlong=keep"]
    )
    assert _rollout_vs_trainer(model, rl, sampling_logprobs=True, length=length) == 0.0
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert _rollout_vs_trainer(model, rl, sampling_logprobs=False, length=length) > 0.1


def _fixed_rollout(model, rl, replies=4):
    """Groups sampled in fixed-shape mode (rl/fixed_rollout.py) from the trainer's own program."""
    from shipyard.rl.fixed_rollout import sample_fixed
    from shipyard.rl.step import make_distribution

    cfg, params, tok = model
    distribution = make_distribution(cfg, rl)
    items = [{"prompt": w} for w in WORDS[:4]]
    prompts = [tuple(tok.encode(i["prompt"], add_special_tokens=False).ids) for i in items]
    return sample_fixed(
        lambda tokens: distribution(params, None, jnp.asarray(tokens)), items, prompts, rl=rl, rows=16,
        length=48, replies=replies, seeds=lambda i, g: 7 * i + g, stop_ids=(0,), decode=tok.decode,
        reward=lambda *_: 0.0,
    )  # fmt: skip


def test_fixed_shape_rollout_log_probs_are_the_trainer_s_bit_for_bit(model):
    """In fixed-shape mode every reply token's log-prob is bitwise the trainer's, with the groups in
    other rows of the trainer's batch than they were drawn in (reversed, after a left-out group);
    the trainer without the rollout's sampling transform is off by far more."""
    from shipyard.rl.rollout import build_batch
    from shipyard.rl.step import make_logps

    cfg, params, _ = model
    settings = ["max_tokens=12", "temperature=0.7", "top_k=5", "top_p=0.95", "overlong=keep"]
    rl = build_rl_config(settings)
    groups = _fixed_rollout(model, rl)
    assert len({r.tokens for g in groups for r in g.replies}) > 8  # sampled, not one reply repeated
    moved = groups[:0:-1]  # 3 groups, reversed: every reply in another row than it was drawn in
    batch = build_batch(moved, np.zeros((3, 4)), 16, 48, rl)
    mask = batch["mask"] > 0
    assert mask.sum() == 12 * rl.max_tokens
    trainer = make_logps(cfg, rl)(params, jnp.asarray(batch["tokens"]))
    assert np.array_equal(trainer[mask], batch["old_logp"][mask])
    plain = build_rl_config(["max_tokens=12", "overlong=keep"])  # the transform off on the trainer's side
    off = make_logps(cfg, plain)(params, jnp.asarray(batch["tokens"]))
    assert np.abs(off[mask] - batch["old_logp"][mask]).max() > 0.1


@pytest.mark.slow
def test_the_update_on_a_data_x_fsdp_mesh_equals_one_device(model):
    """Two optimizer steps (full training and LoRA, with the KL term) on a 2 x 4 CPU mesh: the same
    losses and metrics as on one device within 1e-5, and the same params (see below)."""
    from shipyard.rl.placement import placement_for
    from shipyard.rl.rollout import build_batch
    from shipyard.rl.step import build_optimizer, make_update

    cfg, params, _ = model
    base = ["max_tokens=12", "temperature=0.9", "top_k=20", "overlong=keep", "beta=0.1", "lr=1e-3"]
    base += ["prompts_per_step=4", "group_size=4", "seed=3"]
    groups = _fixed_rollout(model, build_rl_config(base))
    adv = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    for extra in ([], ["finetune={lora: {rank: 4, targets: [q, v, up]}}"]):
        runs = []
        for mesh in ([], ["mesh={data: 2, fsdp: 4}"]):
            rl = build_rl_config([*base, *extra, *mesh])
            place = placement_for(cfg, rl, 48)
            fresh = jax.tree.map(jnp.copy, params)  # (the update donates what it trains)
            trainable, frozen = place.put(place.partition.initial(fresh, jax.random.key(0)),
                                          place.partition.frozen(fresh))  # fmt: skip
            reference = jax.tree.map(jnp.copy, trainable)
            optimizer = build_optimizer(rl)
            state = optimizer.init(trainable)
            update = make_update(cfg, rl, optimizer, place.partition, place.layout)
            batch = place.put_batch(build_batch(groups, adv, 16, 48, rl))
            metrics = []
            for _ in range(2):
                trainable, state, m = update(trainable, state, batch, frozen, reference)
                metrics.append({k: float(v) for k, v in m.items()})
            if mesh:
                assert len(jax.tree.leaves(trainable)[0].sharding.device_set) == 8
            runs.append((metrics, jax.tree.map(np.asarray, trainable)))
        (one, p1), (sharded, p8) = runs
        assert one[1]["loss"] != one[0]["loss"] and one[1]["kl_ref"] > 0
        for a, b in zip(one, sharded):
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (extra, k, a[k], b[k])
        # params within a tenth of one Adam step (lr 1e-3): Adam moves a weight whose gradient is
        # ~0 by lr x g / |g|, so the two programs' rounding of a ~1e-9 gradient shows there (one
        # embedding entry of 24,576 measured 2.6e-5 off); all but 0.1% of the params within 1e-6 (counted
        # over all of them: one entry of a 512-entry LoRA matrix is 0.2% of that matrix, and was seen)
        off = total = 0
        for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
            np.testing.assert_allclose(x, y, atol=1e-4)
            off, total = off + int(np.sum(np.abs(x - y) > 1e-6)), total + x.size
        assert off < 1e-3 * total, (extra, off, total)


def test_a_reward_past_its_time_limit_is_zero_counted_and_said(tmp_path):
    (tmp_path / "r.py").write_text(
        "import time\ndef f(prompt, completion, metadata):\n"
        "    try:\n        time.sleep(30)\n    except Exception:\n        return 5.0\n    return 1.0\n"
    )
    said = []
    reward = tasks.Rewarder(tasks.load_reward(f"{tmp_path / 'r.py'}:f"), 0.2, said.append)
    assert reward("p", "c", {}) == 0.0 and reward("p", "c", {}) == 0.0
    assert reward.failures == {"timeout": 2} and len(said) == 1 and "reward_timeout=0.2" in said[0]


def test_a_short_run_is_on_policy_at_each_batch_s_first_step_and_writes_a_model_dir(
    run_dir, model, tmp_path, capsys
):
    """Three steps through the CLI with a prompt file and a user reward: each batch's first update
    sees ratio exactly 1 and KL(rollout || trainer) exactly 0, the second does not (the policy moved); the metrics
    have every documented field; OUT is a model directory `generate` runs."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS * 2))
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "out"
    settings = [
        f"prompts={prompts}", f"reward={tmp_path / 'reward.py'}:score", "task=null", "steps=3", "group_size=4",
        "prompts_per_step=4", "max_tokens=8", "eval_prompts=4", "eval_every=2", "updates_per_batch=2",
        "temperature=0.9", "top_k=20", "top_p=0.9", "overlong=keep", "lr=1e-3",
    ]  # fmt: skip
    assert main(["rl", str(run_dir), str(out), *settings]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert {"eval_reward", "eval_pass@1", "eval_pass@4"} <= set(lines[0]) and "eval_reward" in lines[2]
    for m in lines[1:]:
        # exactly: the update's forward rounds as the engine's steps did
        assert m["first_ratio_mean"] == 1 and m["first_ratio_max"] == 1 and m["first_kl_rollout"] == 0
        assert abs(m["ratio_mean"] - 1) > 1e-4  # the second update's policy is not the sampler
        for key in ("reward_mean", "reward_min", "reward_max", "reply_tokens", "dropped_fraction",
                    "clip_fraction", "kl_ref", "entropy", "loss", "grad_norm", "rollout_share"):  # fmt: skip
            assert np.isfinite(m[key]), key
        assert m["groups_trained"] >= 1 and 0 < m["rollout_share"] < 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))  # the same numbers as TensorBoard scalars
    events.Reload()
    reward = events.Scalars("reward_mean")
    assert [e.step for e in reward] == [1, 2, 3]
    assert [e.value for e in reward] == pytest.approx([m["reward_mean"] for m in lines[1:]], rel=1e-6)
    assert {"eval_reward", "first_ratio_mean", "kl_ref", "rollout_share"} <= set(events.Tags()["scalars"])
    recorded = _yaml(out / "rl.yaml")
    assert recorded["group_size"] == 4 and recorded["task"] is None and recorded["top_p"] == 0.9
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "the", "--max-new-tokens", "4"]) == 0
    assert _learned_toward_the_reward(model, out) > 0.1  # measured 0.47; -0.31 with negated advantages


def _learned_toward_the_reward(model, out: Path) -> float:
    """The direction of learning: over 64 replies the start model samples to fresh seeds, the
    correlation between a reply's reward (REWARD: its share of 'e') and how much more likely the
    trained model `out` makes it than the start model did (the change of its summed log-prob). To
    first order the trained policy's expected reward minus the start's is their covariance, so it is
    positive when training moved toward the reward and negative when it moved away (advantages with
    the wrong sign)."""
    from shipyard.inference.engine import Engine
    from shipyard.rl.rollout import build_batch, sample_groups
    from shipyard.rl.step import make_logps
    from shipyard.run.model_dir import open_model_dir

    cfg, start, tok = model
    _, _, trained = open_model_dir(out, "test").load()
    rl = build_rl_config(["max_tokens=8", "temperature=1.0", "overlong=keep"])
    items = [{"prompt": w} for w in WORDS[:8]]
    prompts = [tuple(tok.encode(i["prompt"], add_special_tokens=False).ids) for i in items]
    share_of_e = lambda _p, text, _m: text.count("e") / max(len(text), 1)  # noqa: E731 (REWARD)
    groups = sample_groups(
        Engine(start, cfg, max_batch=16, max_len=32), items, prompts, rl=rl, replies=8, temperature=1.0,
        seeds=lambda i, g: 1000 + 8 * i + g, stop_ids=(0,), decode=tok.decode, reward=share_of_e,
    )  # fmt: skip
    batch = build_batch(groups, np.zeros((8, 8)), 64, 32, rl)
    logps = make_logps(cfg, rl)
    gain = [np.asarray(logps(p, jnp.asarray(batch["tokens"]))) * batch["mask"] for p in (trained, start)]
    change = (gain[0] - gain[1]).sum(axis=1)
    rewards = np.array([r.reward for g in groups for r in g.replies])
    assert rewards.std() > 0
    return float(np.corrcoef(rewards, change)[0, 1])


@pytest.mark.slow
def test_a_lora_run_on_a_mesh_in_fixed_shape_mode_changes_only_low_rank_deltas(run_dir, model, tmp_path):
    """LoRA adapters trained on a 2 x 4 mesh with fixed-shape rollouts and the KL term: each batch's
    first update is on-policy, and OUT's merged weights differ from the start by rank-4 deltas on
    the adapted projections only (everything else bit for bit the model's)."""
    from shipyard.run.model_dir import open_model_dir

    cfg, start, _ = model
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "out"
    settings = [
        f"prompts={prompts}", f"reward={tmp_path / 'reward.py'}:score", "task=null", "steps=2", "group_size=4",
        "prompts_per_step=4", "max_tokens=6", "eval_prompts=0", "lr=1e-2", "beta=0.05", "fixed_shape=true",
        "mesh={data: 2, fsdp: 4}", "finetune={lora: {rank: 4, targets: [q, up]}}", "top_k=50", "overlong=keep",
    ]  # fmt: skip
    assert main(["rl", str(run_dir), str(out), *settings]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for m in lines[1:]:
        assert abs(m["first_ratio_mean"] - 1) < 1e-5 and abs(m["first_kl_rollout"]) < 1e-5
    _, _, trained = open_model_dir(out, "test").load()
    for name in ("wq", "w_up"):
        moved = np.asarray(getattr(trained.blocks, name)) - np.asarray(getattr(start.blocks, name))
        flat = moved.reshape(moved.shape[0], moved.shape[1], -1)
        ranks = [np.linalg.matrix_rank(layer, tol=1e-6) for layer in flat]
        assert np.abs(moved).max() > 1e-4 and max(ranks) <= 4, (name, ranks)
    for name in ("wk", "wv", "wo", "w_gate", "w_down"):
        assert np.array_equal(getattr(trained.blocks, name), getattr(start.blocks, name)), name
    assert np.array_equal(trained.embed, start.embed)


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_built_in_tasks_are_reproducible_and_checked_exactly():
    for task in (t for t in tasks.TASKS if t != "code"):
        items = [tasks.task_item(task, 3, i, 2) for i in range(50)]
        assert items == [tasks.task_item(task, 3, i, 2) for i in range(50)]
        assert len({i["prompt"] for i in items}) > 25
        for item in items:
            assert tasks.exact_answer(item["prompt"], f" {item['answer']}\nmore", item) == 1.0
            assert tasks.exact_answer(item["prompt"], item["answer"] + "0", item) == 0.0
    add = tasks.task_item("add", 0, 0, 3)
    a, b = add["prompt"].rstrip("=").split("+")
    assert int(add["answer"]) == int(a) + int(b)
    srt = tasks.task_item("sort", 0, 1, 3)
    assert srt["answer"] == "".join(sorted(srt["prompt"].split()[1].rstrip("=")))


def test_a_reward_that_raises_is_zero_and_counted(tmp_path):
    (tmp_path / "r.py").write_text(
        "def f(prompt, completion, metadata):\n    return 1 / len(completion) if completion != 'nan' else float('nan')\n"
    )
    reward = tasks.Rewarder(tasks.load_reward(f"{tmp_path / 'r.py'}:f"))
    assert reward("p", "ab", {}) == 0.5 and reward("p", "", {}) == 0.0 and reward("p", "nan", {}) == 0.0
    assert reward.failures == {"ZeroDivisionError": 1, "not a finite number": 1}
    assert not (tmp_path / "__pycache__").exists()


@pytest.mark.parametrize(
    "source, says",
    [
        ("def f(prompt, completion):\n    return 0\n", "must take (prompt, completion, metadata)"),
        ("def g(prompt, completion, metadata):\n    return 0\n", "has no function 'f'"),
        ("def f(:\n", "importing"),
        (None, "does not exist"),
    ],
)
def test_a_bad_reward_function_is_one_line(tmp_path, source, says):
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        tasks.load_reward(f"{tmp_path / 'r.py'}:f")


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"prompt": "a"}\n{oops\n', "p.jsonl line 2: not valid JSON"),
        ('{"prompt": "a"}\n[1]\n', "p.jsonl line 2: a list"),
        ('{"text": "a"}\n', "p.jsonl line 1: needs 'prompt'"),
        ("\n\n", "holds no prompts"),
        ('{"messages": [{"role": "user"}]}\n', "p.jsonl line 1: message 0 must be an object with exactly"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
    ],
)
def test_a_bad_prompt_file_names_its_line(tmp_path, text, says):
    path = tmp_path / "p.jsonl"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(DataError, match=says):
        tasks.load_prompts(tmp_path / "p.jsonl")


TIMING = ("rollout_seconds", "train_seconds", "rollout_share")


def _lines(out: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_a_run_stopped_after_a_saved_state_resumes_bitwise(run_dir, tmp_path, monkeypatch):
    """A run that dies at step 3 (its state saved at step 2) and is started again with the same
    command ends with the metrics and params of a run that never stopped; other settings are refused."""
    import orbax.checkpoint as ocp

    from shipyard.rl import loop
    from shipyard.rl.loop import run_rl

    rl = build_rl_config(
        ["task=add", "steps=4", "save_every=2", "group_size=4", "prompts_per_step=2", "max_tokens=6",
         "eval_prompts=2", "eval_every=2", "overlong=keep", "dynamic_sampling=false", "lr=1e-3", "top_k=30"]
    )  # fmt: skip
    run_rl(str(run_dir), tmp_path / "whole", rl, say=lambda m: None)

    real = loop._step_metrics

    def dies_at_3(step, *args):
        if step == 3:
            raise KeyboardInterrupt  # (as a kill would: after state/2 is complete)
        return real(step, *args)

    monkeypatch.setattr(loop, "_step_metrics", dies_at_3)
    with pytest.raises(KeyboardInterrupt):
        run_rl(str(run_dir), tmp_path / "cut", rl, say=lambda m: None)
    assert (
        not (tmp_path / "cut" / "config.yaml").exists() and (tmp_path / "cut" / "state" / "2.json").exists()
    )
    monkeypatch.setattr(loop, "_step_metrics", real)
    with pytest.raises(ConfigError, match="other settings: lr=0.001"):
        run_rl(str(run_dir), tmp_path / "cut", rl.model_copy(update={"lr": 1e-4}), say=lambda m: None)
    said = []
    run_rl(str(run_dir), tmp_path / "cut", rl, say=said.append)
    assert any("resuming" in s and "after step 2" in s for s in said)
    assert _lines(tmp_path / "cut") == _lines(tmp_path / "whole")
    with ocp.StandardCheckpointer() as ckpt:
        a = ckpt.restore((tmp_path / "whole" / "params").absolute())
        b = ckpt.restore((tmp_path / "cut" / "params").absolute())
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    from shipyard.output import OutputExists

    with pytest.raises(OutputExists, match="a finished rl run"):
        run_rl(str(run_dir), tmp_path / "cut", rl, say=lambda m: None)


@pytest.mark.slow
def test_chat_prompts_are_rendered_with_the_model_s_template_and_end_at_its_end_of_turn(run_dir, tmp_path):
    """A prompt file of chats: each is the model's own chat prompt (generation header included), its
    replies stop at the template's end-of-turn token, and the reward sees the last message."""
    from shipyard.rl.loop import run_rl

    chats = [{"messages": [{"role": "user", "content": w}], "want": w} for w in WORDS]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (tmp_path / "r.py").write_text(
        "def f(prompt, completion, metadata):\n    assert prompt == metadata['want']\n    return len(completion) % 3\n"
    )
    settings = [f"prompts={tmp_path / 'p.jsonl'}", f"reward={tmp_path / 'r.py'}:f", "task=null", "steps=2",
                "group_size=4", "prompts_per_step=2", "max_tokens=6", "eval_prompts=2", "overlong=keep"]  # fmt: skip
    last = run_rl(str(run_dir), tmp_path / "out", build_rl_config(settings), say=lambda m: None)
    assert last["reward_failures"] == {}  # the reward saw each chat's last message as the prompt


def test_the_code_task_runs_replies_in_a_sandbox_with_limits_and_no_network():
    """An equivalent expression passes, a wrong one does not; a reply that loops or eats memory is
    killed and counted by reason; the network is unreachable from the child."""
    from shipyard.rl import sandbox

    item = tasks.task_item("code", 0, 4, 2)
    a, b = item["tests"][1][1] - item["tests"][0][1], item["tests"][0][1]
    reward = tasks.Rewarder(tasks.checker("code"))
    assert reward(item["prompt"], f"{b} + {a} * x\nmore", item) == 1.0
    assert reward(item["prompt"], f"{b} + {a + 1} * x", item) == 0.0
    assert reward(item["prompt"], "(", item) == 0.0  # a syntax error is a wrong answer
    assert reward(item["prompt"], "sum(1 for _ in iter(int, 1))", item) == 0.0  # runs forever
    assert reward(item["prompt"], "bytearray(10**9)", item) == 0.0
    assert reward.failures == {"SandboxTimeout": 1, "SandboxMemory": 1}
    probe = "import _socket\ntry:\n    _socket.socket().connect(('1.1.1.1', 80))\nexcept OSError as e:\n    print('refused', e)\n"
    if sandbox.isolated():  # a namespace without network (the `socket` guard alone can be bypassed)
        assert sandbox.run_python(probe).stdout.startswith("refused")
    out = sandbox.run_python(
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80))\nexcept OSError as e:\n    print(e)\n"
    )
    assert "no network in the sandbox" in out.stdout
