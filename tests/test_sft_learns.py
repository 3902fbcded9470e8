"""End to end: chat SFT on a synthetic instruction set answers held-out prompts of the same pattern."""

import json
import os
import subprocess
import sys

import pytest
from chat_fixtures import QUIET, upper_task, write_chats, write_tokenizer


def _cli(*args):
    env = dict(os.environ, XLA_FLAGS="", SHIPYARD_NO_REEXEC="1")  # one device: the fastest here
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.cli", *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _task_files(tmp_path):
    train = write_chats(tmp_path / "train.jsonl", upper_task(0, 2000))
    seen = {json.dumps(c) for c in upper_task(0, 2000)}
    held = [c for c in upper_task(1, 200) if json.dumps(c) not in seen][:100]  # words never trained on
    return train, write_chats(tmp_path / "held.jsonl", held)


def _learns(run, held_out, *train_args):
    """Train 1000 steps, then: held-out val loss < 0.5 nats per assistant token, exact match >= 90%."""
    _cli("train", *train_args, "--run-dir", str(run), "train.steps=1000", "train.optimizer.lr=5e-3")
    val = [
        r["val_loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in r
    ]
    assert len(val) == 2 and val[-1] < 0.5  # nats per assistant token
    out = _cli("eval", str(run), "--task", f"chat:{held_out}")
    report = json.loads((run / "eval.json").read_text())["tasks"]["chat:held"]
    assert report["conversations"] == 100 and report["exact_match"] >= 0.9, out


# (Full SFT with the built-in template is not run to the end here as well: the QLoRA test below trains
# its base with it and learns the task on top, and tests/test_byo_model.py shows an HF template of the
# same layout trains bitwise as the built-in one. One 1000-step run less in the slow tier.)


# shipyard's own layout, written as a Hugging Face Jinja template that injects a default system prompt
DEFAULT_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>Be brief.<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.slow
def test_sft_of_an_imported_model_with_its_own_template(tmp_path):
    """The same task from a model that comes as a Hugging Face directory whose tokenizer brings its own
    Jinja template, one that injects a default system prompt ("Be brief."): the conversations have no
    system message, so every rendering relies on the template's injection. Trained straight from the
    HF directory (weights: tiny's seeded init as safetensors), it reaches what the built-in template
    reaches above."""
    import jax

    from shipyard.config import load_config
    from shipyard.interop.hf import write_hf_dir
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs

    tok = write_tokenizer(tmp_path / "tok")
    tok_config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(
        json.dumps({**tok_config, "chat_template": DEFAULT_SYSTEM_TEMPLATE})
    )
    cfg = load_config("tiny").model
    hf = tmp_path / "hf"
    write_hf_dir(init_params(param_specs(cfg), jax.random.key(0)), cfg, hf, tok)
    train = write_chats(tmp_path / "train.jsonl", upper_task(0, 2000, system=False))
    seen = {json.dumps(c) for c in upper_task(0, 2000, system=False)}
    held = [c for c in upper_task(1, 200, system=False) if json.dumps(c) not in seen][:100]
    held_out = write_chats(tmp_path / "held.jsonl", held)
    chat = f"data.chat={{train: {train}, validation: {held_out}}}"  # tokenizer and template: the model's
    same = ["train.optimizer.weight_decay=0.0", "train.schedule.warmup_steps=20"]  # as the tiny preset trains
    run = tmp_path / "sft"
    _learns(run, held_out, str(hf), "data.seq_len=128", chat, "train.eval_every=500", *same, *QUIET)
    assert "chat_template" in json.loads((run / "tokenizer" / "tokenizer_config.json").read_text())


@pytest.mark.slow
def test_qlora_on_an_nf4_base_learns_the_task(tmp_path):
    """QLoRA: the same task learnt by adapters alone on top of an NF4 base (double-quantized scales).
    The base is a 150-step SFT run that does not do the task yet (exact match < 0.2); 1000 QLoRA steps
    take it to >= 0.9 on held-out words, as LoRA on the fp32 base does (measured: both 1.0)."""
    tok = write_tokenizer(tmp_path / "tok")
    train, held_out = _task_files(tmp_path)
    chat = f"data.chat={{train: {train}, validation: {held_out}, tokenizer: {tok}}}"
    base = tmp_path / "base"
    common = ["tiny", "data.seq_len=128", chat, *QUIET, "train.optimizer.lr=5e-3"]
    _cli("train", *common, "--run-dir", str(base), "train.steps=150")

    def exact_match(run):
        _cli("eval", str(run), "--task", f"chat:{held_out}")
        return json.loads((run / "eval.json").read_text())["tasks"]["chat:held"]["exact_match"]

    assert exact_match(base) < 0.2
    qlora = "{lora: {rank: 16, alpha: 32, targets: [q, k, v, o, gate, up, down]}, quantize_base: nf4, double_quant: true}"
    run = tmp_path / "qlora"
    _cli(
        "train",
        *common,
        "--run-dir",
        str(run),
        "train.steps=1000",
        f"train.init_from={base}",
        f"train.finetune={qlora}",
    )
    assert exact_match(run) >= 0.9
