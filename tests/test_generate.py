"""Generation with a KV cache (the engine, as `shipyard generate` runs it) equals full-forward decoding
and transformers' greedy generate."""

import jax
import jax.numpy as jnp
import pytest
from engine_fixtures import complete, generate
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.engine import engine_for
from shipyard.model.transformer import logits

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


def _params(cfg):
    return noisy_params(cfg, key=2, seed=1, scale=0.2)


PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]


def _greedy_full_forward(params, cfg, prompt, n):
    """Greedy decoding by re-running the whole causal forward each step (right-padded to one shape, so it
    compiles once: causal attention makes position i blind to the padding after it)."""
    width = len(prompt) + n
    forward = jax.jit(lambda toks: logits(params, toks, cfg))
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (width - len(seq))])
        seq.append(int(jnp.argmax(forward(padded)[0, len(seq) - 1])))
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tie_embeddings=true", "model.qk_norm=true"],
        ["model.qkv_bias=true"],
        ["model.sliding_window=5"],  # prompts + 12 new tokens run past the window
        ["model.sliding_window=4", "model.global_attention_every=2"],
    ],
)
def test_cached_greedy_equals_full_forward_for_a_padded_batch(overrides):
    cfg = load_config("tiny", overrides).model
    params = _params(cfg)
    engine = engine_for(params, cfg, PROMPTS, 12)
    got = complete(engine, PROMPTS, 12)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == _greedy_full_forward(params, cfg, prompt, 12)
    assert complete(engine, PROMPTS, 12) == got
    assert engine.decode_compilations() == 1  # one compilation for every decode step and call


def test_sampling_is_seeded_and_stops():
    cfg = load_config("tiny").model
    engine = engine_for(_params(cfg), cfg, PROMPTS, 10)
    a = complete(engine, PROMPTS, 10, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    b = complete(engine, PROMPTS, 10, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    c = complete(engine, PROMPTS, 10, temperature=1.0, top_k=20, top_p=0.9, seed=4)
    assert a == b and a != c
    # a prompt's reply depends on its seed, not on the prompts beside it
    assert complete(engine, PROMPTS[1:2], 10, temperature=1.0, top_k=20, top_p=0.9, seed=3) == a[1:2]
    first = complete(engine, PROMPTS[:1], 10)[0]
    stopped = complete(engine, PROMPTS[:1], 10, stop_ids=(first[2],))[0]
    assert stopped == first[: first.index(first[2]) + 1]


def test_tokens_per_call_changes_nothing_but_how_often_the_host_is_called():
    cfg = load_config("tiny").model
    params = _params(cfg)

    def run(tokens_per_call):
        engine = engine_for(params, cfg, PROMPTS, 11, tokens_per_call=tokens_per_call, fixed_shape=True)
        streamed = []
        greedy = complete(engine, PROMPTS, 11, on_token=lambda b, t: streamed.append((b, t)))
        sampled = complete(engine, PROMPTS, 11, temperature=1.0, top_k=20, seed=5)
        stopped = complete(engine, PROMPTS, 11, stop_ids=(greedy[0][4],), stop=lambda toks: len(toks) == 6)
        # on_token sees every kept token once, each row's in order
        rows = [[t for b, t in streamed if b == row] for row in range(len(PROMPTS))]
        return greedy, sampled, stopped, rows

    one_by_one = run(1)
    greedy, _, stopped, streamed = one_by_one
    assert streamed == greedy
    assert stopped[0] == greedy[0][: greedy[0].index(greedy[0][4]) + 1]
    assert all(len(s) <= 6 for s in stopped)
    for n in (3, 16):
        assert run(n) == one_by_one


def test_a_reply_costs_only_the_decode_steps_it_needs():
    # 11 new tokens: the prefill picks the first, then 10 decode steps in calls of 4, 4 and 2, and no
    # call once every row's last token is in flight (it used to run 16 steps in 4 calls)
    cfg = load_config("tiny").model
    engine = engine_for(_params(cfg), cfg, PROMPTS, 11, tokens_per_call=4)
    decode, steps = engine._decode, []

    def counting(*args, **kwargs):
        steps.append(int(args[4]))
        return decode(*args, **kwargs)

    engine._decode = counting
    got = complete(engine, PROMPTS, 11)
    assert [len(t) for t in got] == [11] * len(PROMPTS)
    assert steps == [4, 4, 2]


def test_greedy_equals_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import json

    from shipyard.interop.hf import hf_config, to_hf_tensors, write_safetensors

    cfg = load_config("tiny").model
    params = _params(cfg)
    write_safetensors(to_hf_tensors(params, cfg), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    ours = generate(params, cfg, PROMPTS, 16)
    for prompt, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        assert out[0, len(prompt) :].tolist() == tokens


def test_generate_cli_on_a_run_trained_on_token_shards(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from data_fixtures import prose, write_jsonl

    from shipyard.cli.main import main

    docs = write_jsonl(tmp_path / "d.jsonl", [prose(s) for s in range(40)])
    assert (
        main(
            ["data", "tokenizer-train", str(docs), "--out", str(tmp_path / "tok"), "--set", "vocab_size=400"]
        )
        == 0
    )
    assert (
        main(
            [
                "data",
                "tokenize",
                str(docs),
                "--out",
                str(tmp_path / "sh"),
                "--tokenizer",
                str(tmp_path / "tok"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    run = tmp_path / "run"
    args = [
        "train",
        "tiny",
        f"data.train_tokens={tmp_path / 'sh'}",
        "train.steps=2",
        "train.logging.progress=false",
    ]
    assert main([*args, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert (
        main(["generate", str(run), "--prompt", "Kabel lodor", "--prompt", "Mi", "--max-new-tokens", "5"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("--- ") == 2 and "\nKabel lodor" in out and "\nMi" in out
