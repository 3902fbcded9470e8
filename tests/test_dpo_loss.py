"""The preference loss against the papers' formulas written in torch on the exported models.

Policy and reference are two tiny shipyard models exported to Hugging Face
format (`write_hf_dir`, what `shipyard export hf` writes) and loaded with
transformers. torch runs every sequence alone and sums its reply tokens'
log-softmax; shipyard runs its packed rows (several pairs per row, segment
ids, positions) through its own forward, `reply_logps` and `preference_sums`.
Loss, d loss / d policy log-probs and the per-pair rewards and margins agree
within 1e-5 (fp32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_fixtures import write_tokenizer
from model_fixtures import noisy_params

from shipyard.config import PreferenceConfig, load_config
from shipyard.data.chat_format import ChatFormat, pick_template
from shipyard.data.preference import pack_pairs, pair_slots, render_pair
from shipyard.data.tokenizer import load_tokenizer
from shipyard.interop.hf import write_hf_dir
from shipyard.model.transformer import logits_and_stats
from shipyard.train.preference_loss import preference_metrics, preference_sums, reply_logps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

SEQ_LEN = 255
PAIRS = [
    ("write a word: cat", "CAT", "cat"),
    ("write a word: horse", "HORSE", "horse, of course"),
    ("say yes", "yes", "no"),
    ("write a word: ox", "OX", "ox"),
    ("count to three", "1 2 3", "one two"),
    ("write a word: lamp", "LAMP", "Lamp"),
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "HELLO"},
]
CONFIGS = {
    "dpo": PreferenceConfig(loss="dpo", beta=0.1),
    "dpo-label-smoothing": PreferenceConfig(loss="dpo", beta=0.25, label_smoothing=0.2),
    "simpo": PreferenceConfig(loss="simpo", beta=2.0, gamma=0.5),
    "simpo-label-smoothing": PreferenceConfig(loss="simpo", beta=2.5, gamma=0.3, label_smoothing=0.1),
    "orpo": PreferenceConfig(loss="orpo", beta=0.1),
    "orpo-strong": PreferenceConfig(loss="orpo", beta=1.5),
}


def _pairs() -> list[dict]:
    """The pairs, every other one after a multi-turn history (its assistant turn is not part of any reply)."""
    out = []
    for i, (prompt, chosen, rejected) in enumerate(PAIRS):
        messages = (HISTORY if i % 2 else []) + [{"role": "user", "content": prompt}]
        out.append({"messages": messages, "chosen": chosen, "rejected": rejected})
    return out


def _torch_reply_logps(model, sequences) -> tuple[np.ndarray, np.ndarray]:
    """Each (ids, mask) alone through the transformers model: the reply tokens' summed log-softmax, and
    how many there are."""
    logps, counts = [], []
    with torch.no_grad():
        for ids, mask in sequences:
            ids = torch.tensor([ids])
            logp = F.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            token_logp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            reply = torch.tensor(mask[1:], dtype=torch.bool)  # targets that are reply tokens
            logps.append(float(token_logp[reply].sum()))
            counts.append(int(reply.sum()))
    return np.array(logps), np.array(counts)


def _where(packed, rendered) -> dict[int, tuple[int, int]]:
    """Pair index -> (row, k): where packing put each pair (matched by the tokens of its first sequence,
    chosen or rejected, so a packer that swaps the two is caught by the log-prob comparison)."""
    out = {}
    for r in range(len(packed)):
        for k in range(int(packed.pair_mask[r].sum())):
            at = np.flatnonzero(packed.segment_ids[r] == 2 * k)
            tokens = packed.tokens[r, at[0] : at[-1] + 1].tolist()
            (i,) = [i for i, p in enumerate(rendered) if tokens in (p.chosen[0], p.rejected[0])]
            out[i] = (r, k)
    assert sorted(out) == list(range(len(rendered)))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Reply log-probs of the same pairs from torch (each sequence alone) and shipyard (packed rows)."""
    root = tmp_path_factory.mktemp("dpo")
    tok_dir = write_tokenizer(root / "tok")
    tok = load_tokenizer(tok_dir)
    fmt = ChatFormat(tok, pick_template("auto", tok))
    rendered = [render_pair(fmt, p) for p in _pairs()]
    packed = pack_pairs(rendered, SEQ_LEN, pad_id=0, seed=0)
    assert len(packed) >= 2 and packed.pair_mask.sum(1).max() >= 2  # several rows, several pairs a row
    cfg = load_config("tiny").model
    forward = jax.jit(lambda p, t, s, q: logits_and_stats(p, t, cfg, segment_ids=s, positions=q)[0])
    num_slots = 2 * pair_slots(SEQ_LEN)
    out = {"where": _where(packed, rendered), "pair_mask": jnp.asarray(packed.pair_mask)}
    for name, seed in (("policy", 10), ("reference", 11)):
        params = jax.tree.map(jnp.asarray, noisy_params(cfg, 0, seed, 0.05))
        write_hf_dir(params, cfg, root / name, tok_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(root / name), torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        chosen = _torch_reply_logps(model, [r.chosen for r in rendered])
        rejected = _torch_reply_logps(model, [r.rejected for r in rendered])
        out[f"torch_{name}"] = (chosen[0], rejected[0])
        out["torch_counts"] = (chosen[1], rejected[1])
        lg = forward(
            params, *(jnp.asarray(a) for a in (packed.tokens[:, :-1], packed.segment_ids, packed.positions))
        )
        out[name], out["counts"] = reply_logps(
            lg, jnp.asarray(packed.tokens[:, 1:]), jnp.asarray(packed.slots), num_slots
        )
    return out


def _per_pair(world, x) -> tuple[np.ndarray, np.ndarray]:
    """Shipyard's [B, 2P] slots as (chosen, rejected) arrays in pair order."""
    x = np.asarray(x)
    at = [world["where"][i] for i in range(len(PAIRS))]
    return np.array([x[r, 2 * k] for r, k in at]), np.array([x[r, 2 * k + 1] for r, k in at])


def _torch_loss(cfg: PreferenceConfig, pi_w, pi_l, ref_w, ref_l, len_w, len_l):
    """The papers' losses, transcribed: (mean loss, chosen rewards, rejected rewards).

    DPO (Rafailov et al., 2023, eq. 7): -log sigma(beta log pi(yw|x)/ref(yw|x) - beta log pi(yl|x)/ref(yl|x)),
    with conservative DPO's label smoothing eps: -(1 - eps) log sigma(h) - eps log sigma(-h).
    SimPO (Meng et al., 2024, eq. 6): -log sigma(beta/|yw| log pi(yw|x) - beta/|yl| log pi(yl|x) - gamma),
    smoothed the same way.
    ORPO (Hong et al., 2024, eqs. 2-7): P(y|x) = exp(1/|y| log pi(y|x)), odds(y|x) = P / (1 - P),
    L = -1/|yw| log pi(yw|x) - lambda log sigma(log(odds(yw|x) / odds(yl|x))), lambda = beta; rewards
    beta/|y| log pi(y|x) (TRL's convention).
    """
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss == "orpo":
        p_w, p_l = torch.exp(pi_w / len_w), torch.exp(pi_l / len_l)
        odds_w, odds_l = p_w / (1 - p_w), p_l / (1 - p_l)
        losses = -pi_w / len_w - beta * F.logsigmoid(torch.log(odds_w / odds_l))
        return losses.mean(), beta / len_w * pi_w, beta / len_l * pi_l
    if cfg.loss == "dpo":
        chosen_reward = beta * (pi_w - ref_w)  # beta log pi(yw|x) / ref(yw|x)
        rejected_reward = beta * (pi_l - ref_l)
        h = chosen_reward - rejected_reward
    else:
        chosen_reward = beta / len_w * pi_w
        rejected_reward = beta / len_l * pi_l
        h = chosen_reward - rejected_reward - cfg.gamma
    losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    return losses.mean(), chosen_reward, rejected_reward


def test_the_same_models_give_the_same_reply_logps(world):
    for name in ("policy", "reference"):
        chosen, rejected = _per_pair(world, world[name])
        np.testing.assert_allclose(chosen, world[f"torch_{name}"][0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(rejected, world[f"torch_{name}"][1], rtol=0, atol=1e-4)
    counts = _per_pair(world, world["counts"])
    np.testing.assert_array_equal(counts[0], world["torch_counts"][0])
    np.testing.assert_array_equal(counts[1], world["torch_counts"][1])
    # the replies alone: "CAT" + <|end|> is 4 tokens; the history's HELLO is never counted
    assert counts[0][0] == 4 and counts[0][1] == len("HORSE") + 1
    # slots with no pair hold nothing
    empty = np.asarray(world["pair_mask"]).repeat(2, axis=1) == 0
    assert np.all(np.asarray(world["counts"])[empty] == 0) and np.all(np.asarray(world["policy"])[empty] == 0)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_loss_gradient_and_rewards_equal_the_torch_transcription(world, case):
    cfg = CONFIGS[case]
    pw, pl = (torch.tensor(x, requires_grad=True) for x in world["torch_policy"])
    rw, rl = (torch.tensor(x) for x in world["torch_reference"])
    lw, ll = (torch.tensor(x, dtype=torch.float64) for x in world["torch_counts"])
    loss, chosen_reward, rejected_reward = _torch_loss(cfg, pw, pl, rw, rl, lw, ll)
    loss.backward()
    reference = world["reference"] if cfg.loss == "dpo" else None

    def mean_loss(policy):
        sums = preference_sums(policy, reference, world["counts"], world["pair_mask"], cfg)
        return preference_metrics(sums)["loss"], sums

    (ours, sums), grad = jax.value_and_grad(mean_loss, has_aux=True)(world["policy"])
    metrics = preference_metrics(sums)
    np.testing.assert_allclose(float(ours), loss.item(), rtol=0, atol=1e-5)
    grad_w, grad_l = _per_pair(world, grad)
    np.testing.assert_allclose(grad_w, pw.grad.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(grad_l, pl.grad.numpy(), rtol=0, atol=1e-5)
    assert np.all(np.asarray(grad)[np.asarray(world["pair_mask"]).repeat(2, axis=1) == 0] == 0)
    # the per-pair rewards and margins: recomputed from one pair at a time through preference_sums
    for i, (r, k) in world["where"].items():
        one = np.zeros_like(np.asarray(world["pair_mask"]))
        one[r, k] = 1.0
        s = preference_sums(world["policy"], reference, world["counts"], jnp.asarray(one), cfg)
        c, j = float(chosen_reward[i]), float(rejected_reward[i])
        np.testing.assert_allclose(
            [float(s.chosen_rewards), float(s.rejected_rewards), float(s.margin)],
            [c, j, c - j],
            rtol=0,
            atol=1e-5,
        )
    margins = (chosen_reward - rejected_reward).detach().numpy()
    np.testing.assert_allclose(float(metrics["reward_margin"]), margins.mean(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(metrics["pref_accuracy"]), np.mean(margins > 0), rtol=0, atol=1e-7)
    np.testing.assert_allclose(float(metrics["chosen_logps"]), world["torch_policy"][0].mean(), atol=2e-5)
    np.testing.assert_allclose(float(metrics["rejected_logps"]), world["torch_policy"][1].mean(), atol=2e-5)
    assert float(sums.pairs) == len(PAIRS)


def test_preference_sums_add_up_over_microbatches_and_ignore_empty_slots(world):
    cfg = CONFIGS["dpo-label-smoothing"]
    policy, reference, counts, mask = world["policy"], world["reference"], world["counts"], world["pair_mask"]
    whole = preference_sums(policy, reference, counts, mask, cfg)
    parts = [
        preference_sums(policy[i : i + 1], reference[i : i + 1], counts[i : i + 1], mask[i : i + 1], cfg)
        for i in range(policy.shape[0])
    ]
    for field in whole.__dataclass_fields__:
        total = sum(float(getattr(p, field)) for p in parts)
        np.testing.assert_allclose(total, float(getattr(whole, field)), rtol=1e-6, atol=1e-6)
    # garbage in the slots of absent pairs changes nothing
    empty = jnp.repeat(mask, 2, axis=1) == 0
    noisy = preference_sums(
        jnp.where(empty, 123.0, policy), jnp.where(empty, -7.0, reference), counts, mask, cfg
    )
    for field in whole.__dataclass_fields__:
        assert float(getattr(noisy, field)) == float(getattr(whole, field))


def test_reply_logps_equal_numpy_log_softmax_per_slot():
    rng = np.random.default_rng(0)
    b, length, vocab, num_slots = 3, 9, 13, 6
    logits = rng.standard_normal((b, length, vocab)).astype(np.float32) * 3
    targets = rng.integers(0, vocab, (b, length))
    slots = rng.integers(-1, num_slots - 1, (b, length))  # slot num_slots - 1 stays empty
    slots[1] = -1  # a row with no reply token at all
    logps, counts = reply_logps(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(slots), num_slots)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    token = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    expected = np.array([[token[r][slots[r] == s].sum() for s in range(num_slots)] for r in range(b)])
    np.testing.assert_allclose(np.asarray(logps), expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(counts), [[np.sum(slots[r] == s) for s in range(num_slots)] for r in range(b)]
    )
    assert logps.dtype == jnp.float32 and np.all(np.asarray(logps)[:, -1] == 0)
    # the gradient: d sum_s w_s logp_s / d logits = w_slot (onehot(target) - softmax) on reply tokens
    w = rng.standard_normal((b, num_slots)).astype(np.float32)
    grad = jax.grad(
        lambda x: jnp.sum(w * reply_logps(x, jnp.asarray(targets), jnp.asarray(slots), num_slots)[0])
    )(jnp.asarray(logits))
    weight = np.where(slots >= 0, np.take_along_axis(w, np.maximum(slots, 0), 1), 0.0)
    onehot = np.eye(vocab)[targets]
    np.testing.assert_allclose(
        np.asarray(grad), weight[..., None] * (onehot - np.exp(log_softmax)), atol=1e-5
    )
    # bf16 logits are upcast: the sums are fp32 either way
    half, _ = reply_logps(
        jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets), jnp.asarray(slots), num_slots
    )
    assert half.dtype == jnp.float32


def test_no_gradient_flows_into_the_reference_log_probs(world):
    """The reference model is frozen: even where its log-probs are computed inside the differentiated
    function (on-the-fly reference), the DPO loss has zero gradient with respect to them, and a
    nonzero one with respect to the policy's."""
    cfg = CONFIGS["dpo-label-smoothing"]
    policy, reference, counts, mask = world["policy"], world["reference"], world["counts"], world["pair_mask"]

    def loss(p, r):
        return preference_sums(p, r, counts, mask, cfg).loss

    d_policy, d_reference = jax.grad(loss, argnums=(0, 1))(policy, reference)
    assert float(jnp.max(jnp.abs(d_reference))) == 0.0
    assert float(jnp.max(jnp.abs(d_policy))) > 1e-3
