"""The lm-evaluation-harness adapter, checked against shipyard's own scoring and generation.

A random tiny model is saved as a run directory next to token shards (so the
run finds its tokenizer), a multiple-choice task is written as an lm-eval YAML
config + JSONL in tmp_path, and lm-eval runs it through its Python API and its
command line; accuracy and every per-choice log-likelihood must equal
`shipyard eval`'s.
"""

import json
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data_fixtures import MC_ROWS, prose, write_jsonl
from engine_fixtures import complete
from model_fixtures import noisy_params, save_run

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file: never ask the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from shipyard.config import load_config  # noqa: E402
from shipyard.data.configs import ReadConfig, TokenizeConfig, TokenizerTrainConfig  # noqa: E402
from shipyard.data.tokenize import run_tokenize  # noqa: E402
from shipyard.data.tokenizer import load_tokenizer, run_tokenizer_train  # noqa: E402
from shipyard.eval.loglik import loglikelihoods  # noqa: E402
from shipyard.eval.tasks import multiple_choice  # noqa: E402
from shipyard.inference.engine import Engine  # noqa: E402
from shipyard.model.transformer import logits  # noqa: E402

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval")
    docs = write_jsonl(d / "docs.jsonl", [prose(s) for s in range(30)])
    run_tokenizer_train([str(docs)], d / "tok", TokenizerTrainConfig(vocab_size=400), ReadConfig())
    run_tokenize([str(docs)], d / "shards", d / "tok", TokenizeConfig(), ReadConfig(), workers=1)
    cfg = load_config("tiny", [f"data.train_tokens={d / 'shards'}", "model.vocab_size=400"])
    params = noisy_params(cfg.model, key=0, seed=0, scale=0.2)
    save_run(d / "run", cfg, params)

    mc = d / "mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "shipyard_mc.yaml").write_text(
        "\n".join(
            [
                "task: shipyard_mc",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {json.dumps(str(mc))}",
                f"  cache_dir: {json.dumps(str(d / 'hf-datasets'))}",
                "test_split: test",
                "output_type: multiple_choice",
                "doc_to_text: context",
                "doc_to_choice: choices",
                "doc_to_target: label",
                'target_delimiter: ""',
                "metric_list:",
                "  - metric: acc",
                "  - metric: acc_norm",
                "",
            ]
        )
    )
    return {
        "dir": d,
        "run": d / "run",
        "cfg": cfg.model,
        "params": params,
        "tok": load_tokenizer(d / "shards"),
        "mc": mc,
        "tasks": tasks,
    }


@pytest.fixture(scope="module")
def lm(setup):
    """The adapter around the run's params (loading the run itself is what the lm-eval runs below do)."""
    from shipyard.lm_eval_adapter import ShipyardLM

    return ShipyardLM.from_params(setup["params"], setup["cfg"], setup["dir"] / "shards", batch_size=4)


@pytest.fixture(scope="module")
def lm16(setup):
    """The same model evaluated with a 16-token window."""
    from shipyard.lm_eval_adapter import ShipyardLM

    return ShipyardLM.from_params(
        setup["params"], setup["cfg"], setup["dir"] / "shards", batch_size=3, max_length=16
    )


WIDTH = 64


@partial(jax.jit, static_argnames=("cfg",))
def _logp(params, tokens, cfg):
    return jax.nn.log_softmax(logits(params, tokens[None], cfg))[0]


def _logprobs(params, cfg, tokens: list[int]) -> np.ndarray:
    """Log-probabilities [len, vocab] from one forward pass (right-padded to WIDTH: one compilation;
    causal attention makes the padding invisible)."""
    assert len(tokens) <= WIDTH
    return np.asarray(_logp(params, jnp.asarray(tokens + [0] * (WIDTH - len(tokens)), jnp.int32), cfg))


def _direct(params, cfg, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) and greedy-ness from one full forward pass, position by position."""
    seq = ctx + cont
    logp = _logprobs(params, cfg, seq[:-1])
    idx = range(len(ctx) - 1, len(seq) - 1)
    return float(sum(logp[i, seq[i + 1]] for i in idx)), all(
        int(np.argmax(logp[i])) == seq[i + 1] for i in idx
    )


def _mc_expectations(setup):
    """shipyard eval's accuracies, and its per-choice log-likelihoods (context and choice encoded apart)."""
    tok, cfg, params = setup["tok"], setup["cfg"], setup["params"]
    pairs = [
        (tok.encode(r["context"], add_special_tokens=False).ids, tok.encode(c, add_special_tokens=False).ids)
        for r in MC_ROWS
        for c in r["choices"]
    ]
    scores = [s for s, _ in loglikelihoods(params, cfg, pairs)]
    per_row, at = [], 0
    for r in MC_ROWS:
        per_row.append(scores[at : at + len(r["choices"])])
        at += len(r["choices"])
    return multiple_choice(params, cfg, tok, setup["mc"]), per_row


def test_multiple_choice_through_simple_evaluate_equals_shipyard_eval(setup):
    from lm_eval.tasks import TaskManager

    import shipyard.lm_eval_adapter  # noqa: F401  (registers the "shipyard" model)

    out = lm_eval.simple_evaluate(
        model="shipyard",
        model_args={"checkpoint": str(setup["run"]), "batch_size": 4},
        tasks=["shipyard_mc"],
        task_manager=TaskManager(include_path=str(setup["tasks"]), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    want, want_ll = _mc_expectations(setup)
    got = out["results"]["shipyard_mc"]
    assert got["acc,none"] == want["accuracy"] and got["acc_norm,none"] == want["accuracy_norm"]
    assert 0 < want["accuracy"] < 1 or 0 < want["accuracy_norm"] < 1  # the choices really are decided
    samples = sorted(out["samples"]["shipyard_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_ROWS)
    for sample, expected in zip(samples, want_ll):
        lls = [float(r[0][0]) for r in sample["resps"]]
        assert lls == pytest.approx(expected, abs=1e-4)


def test_lm_eval_command_line(setup, tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "shipyard.lm_eval_adapter",
        "--model",
        "shipyard",
        "--model_args",
        f"checkpoint={setup['run']},batch_size=4",
        "--tasks",
        "shipyard_mc",
        "--include_path",
        str(setup["tasks"]),
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1, proc.stdout[-2000:]
    got = json.loads(files[0].read_text())["results"]["shipyard_mc"]
    want, _ = _mc_expectations(setup)
    assert got["acc,none"] == want["accuracy"] and got["acc_norm,none"] == want["accuracy_norm"]


def test_loglikelihood_split_at_a_merged_token_and_empty_context(setup, lm):
    tok, cfg, params = setup["tok"], setup["cfg"], setup["params"]
    text = "Kabel lodor mifin pegat zumon"
    enc = tok.encode(text, add_special_tokens=False)
    # cut inside the first token of 3+ characters: a BPE merge crosses the context/continuation boundary
    k = next(i for i, (a, b) in enumerate(enc.offsets) if b - a >= 3 and i > 0)
    cut = enc.offsets[k][0] + 2
    ctx, cont = text[:cut], text[cut:]
    assert tok.encode(ctx).ids + tok.encode(cont).ids != enc.ids  # encoding apart would differ
    ctx_ids, cont_ids = lm.split_pair(ctx, cont)
    assert ctx_ids + cont_ids == enc.ids and ctx_ids == enc.ids[:k]  # the straddling token is scored
    eos = lm.eot_token_id
    (ll, greedy), (ll_empty, _) = lm.loglikelihood(
        [
            Instance("loglikelihood", {}, (ctx, cont), 0),
            Instance("loglikelihood", {}, ("", " Kabel lodor"), 1),
        ]
    )
    assert (ll, greedy) == pytest.approx(_direct(params, cfg, ctx_ids, cont_ids), abs=1e-4)
    want_empty = _direct(params, cfg, [eos], tok.encode(" Kabel lodor").ids)[0]
    assert ll_empty == pytest.approx(want_empty, abs=1e-4)


def test_is_greedy_and_left_truncation(setup, lm, lm16):
    tok, cfg, params = setup["tok"], setup["cfg"], setup["params"]
    prompt = tok.encode("Kabel lodor mifin").ids
    greedy = complete(Engine(params, cfg, max_batch=1, max_len=64), [prompt], 6)[0]
    other = tok.encode(" pegat zumon").ids
    assert other != greedy[: len(other)]
    # token level (what lm-eval's TemplateLM calls after tokenizing): greedy tokens are greedy, others not
    (ll, is_greedy), (_, not_greedy) = lm._loglikelihood_tokens(
        [(None, prompt, greedy), (("Kabel lodor mifin", " pegat zumon"), prompt, other)]
    )
    assert is_greedy and not not_greedy
    assert ll == pytest.approx(_direct(params, cfg, prompt, greedy)[0], abs=1e-4)

    long_ctx = tok.encode(prose(7, words=40)).ids
    assert len(long_ctx) > 30
    cont = tok.encode(" pegat zumon tolis").ids
    (ll_cut, _), _ = lm16.loglikelihood(
        [
            Instance("loglikelihood", {}, (tok.decode(long_ctx), " pegat zumon tolis"), 0),
            Instance("loglikelihood", {}, ("Mi", " ra"), 1),
        ]
    )
    whole = (long_ctx + cont)[-17:]  # max_length + 1 tokens, cut from the left
    assert ll_cut == pytest.approx(_direct(params, cfg, whole[: -len(cont)], cont)[0], abs=1e-4)


def test_loglikelihood_rolling_equals_summed_token_logprobs(setup, lm, lm16):
    tok, cfg, params = setup["tok"], setup["cfg"], setup["params"]
    eos = lm.eot_token_id
    short_text, long_text = "Kabel lodor mifin pegat.", prose(11, words=30)
    short, long = tok.encode(short_text).ids, tok.encode(long_text).ids
    got = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([short_text, long_text])]
    )
    # one window each (max_length 256): every token scored after EOS and all the tokens before it
    want = [loglikelihoods(params, cfg, [([eos], toks)])[0][0] for toks in (short, long)]
    assert got == pytest.approx(want, abs=1e-3)

    # max_length 16: disjoint windows, each predicting up to 16 tokens with up to 16 tokens of input
    L = 16
    assert len(long) > 3 * L
    seq = np.array([eos, *long])
    want_windows, predicted, start = 0.0, 0, 0
    while start < len(long):
        end = min(start + L, len(long))
        inputs = seq[max(0, end - L) : end]  # seq[j] is the input that predicts long[j]
        logp = _logprobs(params, cfg, inputs.tolist())
        for j in range(start, end):
            want_windows += float(logp[j - max(0, end - L), long[j]])
            predicted += 1
        start = end
    assert predicted == len(long)
    got_windows = lm16.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0)])
    assert got_windows[0] == pytest.approx(want_windows, abs=1e-3)
    assert abs(got_windows[0] - want[1]) > 1e-2  # less context: a different number


def test_generate_until_equals_generator_greedy_with_stops(setup, lm):
    tok, cfg, params = setup["tok"], setup["cfg"], setup["params"]
    eos = lm.eot_token_id
    prompts = ["Kabel lodor", "Mi", "Simon rasen tovel kafin pegat"]
    alone = Engine(params, cfg, max_batch=1, max_len=64)

    def reference(prompt: str, n: int) -> str:
        tokens = complete(alone, [tok.encode(prompt).ids], 12)[0][:n]  # alone, not in a batch
        return tok.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)

    full = [reference(p, 12) for p in prompts]
    stop = full[0][3:5]  # occurs in the first completion, after its start
    assert stop and full[0].index(stop) >= 1

    def cut(text: str) -> str:
        return text[: text.index(stop)] if stop in text else text

    requests = [
        Instance("generate_until", {}, (p, {"until": [stop], "max_gen_toks": 12, "do_sample": False}), i)
        for i, p in enumerate(prompts)
    ] + [Instance("generate_until", {}, (prompts[2], {"until": [], "max_gen_toks": 5}), 3)]
    got = lm.generate_until(requests)
    assert got[:3] == [cut(t) for t in full]
    assert got[0] == full[0][: full[0].index(stop)] and len(got[0]) < len(full[0])
    assert got[3] == reference(prompts[2], 5)


def test_shipyard_imports_without_lm_eval():
    code = (
        "import sys\n"
        "sys.modules['lm_eval'] = None  # as if not installed\n"
        "import shipyard, shipyard.cli.main, shipyard.eval.evaluate, shipyard.inference.engine, shipyard.interop.hf\n"
        "try:\n"
        "    import shipyard.lm_eval_adapter\n"
        "except ImportError as e:\n"
        "    print('hint' if 'shipyard[lm-eval]' in str(e) else e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "hint"
