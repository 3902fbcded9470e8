import colorsys
import inspect
import json.decoder

import pytest

from shipyard.data import filters
from shipyard.data.configs import FilterConfig
from shipyard.data.filters import failed_rule

GOOD_PROSE = (
    "The river had risen overnight, and by morning the lower fields were under water. "
    "Farmers gathered at the bridge to decide whether the old levee would hold another storm. "
    "Some argued for sandbags along the eastern bank, while others wanted to open the sluice "
    "gates and let the meadow flood on purpose. By noon they had agreed on a plan, and the "
    "whole village spent the afternoon carrying sacks of sand down the muddy lane to the bank."
)
GOOD_CODE = [inspect.getsource(m) for m in (colorsys, json.decoder, filters)]


def test_good_prose_and_code_pass():
    assert failed_rule(GOOD_PROSE, FilterConfig()) is None
    for code in GOOD_CODE:
        assert failed_rule(code, FilterConfig(profile="code")) is None
    # the prose rules would wrongly throw real source code out (numbers-heavy, repetitive)
    assert failed_rule(GOOD_CODE[0], FilterConfig()) == "alpha_words"
    assert failed_rule(GOOD_CODE[1], FilterConfig()) == "duplicate_ngrams"


@pytest.mark.parametrize(
    "text, cfg, rule",
    [
        ("too short to keep", FilterConfig(), "min_words"),
        (GOOD_PROSE, FilterConfig(max_words=20), "max_words"),
        (GOOD_PROSE, FilterConfig(min_chars=10_000), "min_chars"),
        (" ".join(["a b c d e"] * 20), FilterConfig(), "mean_word_length"),
        (" ".join(["incomprehensibilities"] * 60), FilterConfig(), "mean_word_length"),
        (" ".join(["12345 67890 4242"] * 20), FilterConfig(), "alpha_words"),
        (GOOD_PROSE.replace(". ", " ### ... "), FilterConfig(), "symbol_ratio"),
        ("\n".join([GOOD_PROSE[:80]] * 10 + [GOOD_PROSE]), FilterConfig(), "duplicate_lines"),
        ("the cat " * 40 + GOOD_PROSE, FilterConfig(), "top_ngram"),
        (GOOD_PROSE + " " + GOOD_PROSE[:200] + " " + GOOD_PROSE[:200], FilterConfig(), "duplicate_ngrams"),
        (
            GOOD_PROSE.replace(". ", "\n"),
            FilterConfig(min_terminal_punct_line_fraction=0.5),
            "terminal_punctuation",
        ),
        (
            "\n".join(["x = compute(a, b, c)  # same line"] * 30),
            FilterConfig(profile="code"),
            "duplicate_lines",
        ),
    ],
)
def test_each_rule_drops_what_it_should(text, cfg, rule):
    assert failed_rule(text, cfg) == rule


def test_rules_can_be_disabled():
    off = FilterConfig(min_words=None, min_mean_word_length=None, max_duplicate_line_fraction=None)
    assert failed_rule("short but allowed words", off) is None
