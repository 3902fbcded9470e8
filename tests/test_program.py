"""One train program: what `shipyard plan` compiles is what `shipyard train` runs, shardings included."""

import dataclasses

import jax
import pytest
from chat_fixtures import upper_task, write_chats, write_tokenizer
from jax.sharding import PartitionSpec

from shipyard.config import build_config, load_config, read_yaml, to_yaml
from shipyard.model.params import param_shardings
from shipyard.plan import plan_program
from shipyard.train import trainer
from shipyard.train.program import build_program

MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
RUN = ["train.steps=1", "train.logging.progress=false", "train.logging.tensorboard=false"]


def _train_capturing_inputs(cfg, run_dir, monkeypatch) -> tuple:
    """Run `train` for one step; (its program, the arguments it handed the jitted train step)."""
    seen = {}

    def spy(*args, **kwargs):
        program = build_program(*args, **kwargs)
        seen["program"] = program

        def step(*inputs):
            seen.setdefault("inputs", inputs)
            return program.train_step(*inputs)

        return dataclasses.replace(program, train_step=step)

    monkeypatch.setattr(trainer, "build_program", spy)
    trainer.train(cfg, run_dir=run_dir)
    return seen["program"], seen["inputs"]


def _layout(tree) -> list:
    """(key path, shape, dtype) of every leaf, and the tree's structure, to compare argument trees."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in leaves]


def _specs(shardings, shapes) -> list:
    """Each sharding in a canonical form (trailing unsplit dims dropped): equal iff the layouts are."""
    out = []
    for sh, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)):
        spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
        out.append((tuple(sh.mesh.shape.items()), tuple(d.id for d in sh.mesh.devices.flat), spec))
    return out


def _config(kind: str, tmp_path, byte_tokens):
    if kind == "pretraining":
        overrides = [f"data.train_tokens={byte_tokens}", "data.document_masking=true", "data.eos_id=10"]
    else:
        tok = write_tokenizer(tmp_path / "tok")
        chats = write_chats(tmp_path / "chats.jsonl", upper_task(0, 40))
        overrides = [
            "data.seq_len=128",
            f"data.chat={{train: {chats}, tokenizer: {tok}}}",
            "train.finetune.lora.rank=4",
        ]
    return load_config("tiny", [*MESH, *RUN, "train.microbatches=2", *overrides])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretraining", "chat_sft"])
def test_plan_compiles_the_step_train_runs_with_the_same_input_shardings(
    kind, tmp_path, byte_tokens, monkeypatch
):
    cfg = _config(kind, tmp_path, byte_tokens)
    program, inputs = _train_capturing_inputs(cfg, tmp_path / "run", monkeypatch)
    # plan's child rebuilds the config from YAML and compiles with abstract inputs
    planned = plan_program(build_config(read_yaml(to_yaml(cfg), "plan config")))
    compiled = planned.lower_train_step().compile()
    plan_args = (planned.abstract_state, planned.abstract_batch, planned.abstract_frozen)
    plan_shardings = compiled.input_shardings[0]

    batch_keys = {
        "pretraining": ["tokens", "loss_mask"],
        "chat_sft": ["tokens", "loss_mask", "segment_ids", "positions"],
    }
    assert list(inputs[1]) == list(planned.abstract_batch) == batch_keys[kind]
    # same arguments (structure, shapes, dtypes) ...
    assert jax.tree.structure(inputs) == jax.tree.structure(plan_args)
    assert _layout(inputs) == _layout(plan_args)
    # ... laid out the same: what train fed its step, what its jit declares, what the plan compiled
    fed = jax.tree.map(lambda x: x.sharding, inputs)
    declared = program.lower_train_step().compile().input_shardings[0]
    assert _specs(fed, inputs) == _specs(declared, inputs) == _specs(plan_shardings, inputs)

    # and the layout is the intended one, not merely the same wrong one on both sides
    batch_axes = ("data", "fsdp")
    for key, sharding in planned.batch_shardings.items():
        assert tuple(sharding.spec)[:1] == (batch_axes,), key
    params = planned.abstract_state.params
    rules_table = param_shardings(planned.specs, planned.mesh, planned.rules)
    assert _specs(jax.tree.map(lambda x: x.sharding, params), params) == _specs(rules_table, params)
    assert any(sh.spec != PartitionSpec() for sh in jax.tree.leaves(program.shardings))


def test_the_layout_is_derived_once():
    """The pipeline schedule and the context order come from (config, mesh) in one place,
    `parallel/layout.py: layout_for`; the program, its steps, the banner and the planner take the
    Layout it builds (a second derivation, say a `schedule_for` call in the train step, is what the
    renovation removed: the step and the banner could disagree with the program)."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "shipyard"
    derivations = {"schedule_for(", "zigzag_order("}
    found = []
    for path in sorted(src.rglob("*.py")):
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if any(d in code for d in derivations) and not re.match(r"\s*def ", code):
                found.append((str(path.relative_to(src)), code.strip()))
    # layout.py derives both; context.py's check_config only validates the seq_len split.
    assert sorted({f for f, _ in found}) == ["parallel/context.py", "parallel/layout.py"], found
    assert len(found) == 3, found
    cfg = load_config("tiny", ["mesh.pipeline=2", "mesh.data=4", "train.pipeline={microbatches: 2}"])
    program = build_program(cfg, None)
    assert program.layout.schedule.stages == 2 and program.layout.schedule.microbatches == 2
    assert program.mesh is program.layout.mesh and program.rules is program.layout.rules
