"""The rollout rules of `shipyard rl` (rl/rollout.py) on hand-made replies: the overlong rule (mask,
the default, and penalty), what a batch row holds, which groups dynamic sampling keeps, and pass@k."""

from __future__ import annotations

import numpy as np
import pytest

from shipyard.config import build_rl_config
from shipyard.rl.rollout import Group, Reply, build_batch, finish_reply, informative, pass_at

STOP = 0


def _finish(tokens, rl, reward=0.5):
    return finish_reply(
        {"prompt": "p"}, tokens, [-0.1 * (i + 1) for i in range(len(tokens))], rl=rl, stop_ids=(STOP,),
        decode=lambda ids: " ".join(map(str, ids)), reward=lambda *_: reward,
    )  # fmt: skip


def test_a_reply_cut_at_max_tokens_is_overlong_and_one_that_ends_is_not():
    rl = build_rl_config(["max_tokens=3"])
    assert rl.overlong == "mask"  # the default
    cut, ended, short = _finish((5, 6, 7), rl), _finish((5, 6, STOP), rl), _finish((5,), rl)
    assert cut.overlong and not ended.overlong and not short.overlong
    assert ended.text == "5 6" and cut.text == "5 6 7"  # the end token is not the reward's to read


def test_penalty_adds_to_an_overlong_reply_s_reward_only():
    rl = build_rl_config(["max_tokens=3", "overlong=penalty", "overlong_penalty=-0.75"])
    assert _finish((5, 6, 7), rl).reward == pytest.approx(0.5 - 0.75)
    assert _finish((5, 6, STOP), rl).reward == 0.5
    for keep in ("mask", "keep"):
        assert _finish((5, 6, 7), build_rl_config(["max_tokens=3", f"overlong={keep}"])).reward == 0.5


@pytest.mark.parametrize("rule", ["mask", "keep"])
def test_mask_leaves_an_overlong_reply_out_of_the_loss_and_keep_trains_it(rule):
    """Rows hold prompt then reply; the loss mask covers exactly the reply's tokens (position t predicts
    token t + 1), with the rollout's log-probs beside them and each reply's advantage; under mask an
    overlong reply's row has no trained position."""
    rl = build_rl_config(["max_tokens=3", f"overlong={rule}"])
    replies = (_finish((5, 6, 7), rl), _finish((8, STOP), rl))
    group = Group({"prompt": "p"}, (1, 2), replies)
    batch = build_batch([group], np.array([[1.5, -1.5]]), rows=4, length=8, rl=rl)
    assert batch["tokens"][:2].tolist() == [[1, 2, 5, 6, 7, 0, 0, 0], [1, 2, 8, STOP, 0, 0, 0, 0]]
    assert batch["advantages"].tolist() == [1.5, -1.5, 0, 0]
    assert batch["mask"][1].tolist() == [0, 1, 1, 0, 0, 0, 0]
    assert batch["old_logp"][1, 1:3].tolist() == pytest.approx([-0.1, -0.2])
    assert batch["mask"][2:].sum() == 0  # padding rows train nothing
    overlong_row = batch["mask"][0].tolist()
    assert overlong_row == ([0, 1, 1, 1, 0, 0, 0] if rule == "keep" else [0] * 7)


def _group(*rewards):
    return Group({}, (1,), tuple(Reply((2,), (-0.1,), "", False, r) for r in rewards))


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_and_pass_at_k_counts_groups():
    assert informative(_group(0.0, 1.0, 1.0)) and not informative(_group(1.0, 1.0, 1.0))
    assert not informative(_group(0.0, 0.0))
    groups = [_group(0.0, 1.0), _group(0.2, 0.4), _group(1.0, 1.0), _group(0.0, 0.0)]
    assert pass_at(groups) == 0.5  # a reply reaching 1.0 in the first and the third
    assert pass_at(groups, threshold=0.3) == 0.75
    assert pass_at([]) == 0.0
