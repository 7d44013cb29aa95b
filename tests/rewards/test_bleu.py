"""Short-form BLEU (SPEC §7; prs_vspo.txt eq. 10–12)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.rewards import normalize_answer, short_form_bleu, short_form_bleu_tokens
from tests import spec_examples
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text


@pytest.mark.parametrize("case", spec_examples.load()["short_form_bleu_tokens"]["cases"])
def test_spec_examples(case):
    assert short_form_bleu_tokens(case["pred"], case["ref"]) == pytest.approx(
        case["expected"], abs=1e-12
    )


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        # c = r = 1, max_n = 1, p1 = 1, BP = exp(1 − 1/1) = 1
        ("paris", "paris", 1.0),
        # c = 2, max_n = 2: bigram (barack, obama) not in ref → p2 = 0
        ("barack obama", "obama", 0.0),
        # c = 3, max_n = 3: the one trigram is not in a 2-token ref → p3 = 0
        ("eiffel tower paris", "eiffel tower", 0.0),
        # exact 5-token match: max_n = 4, all p_n = 1, c = r → BP = 1
        ("a b c d e", "a b c d e", 1.0),
        # trigrams (a b x), (b x d) vs (a b c), (b c d) → p3 = 0
        ("a b x d", "a b c d", 0.0),
        ("tokyo", "kyoto", 0.0),
        # p1 = p2 = p3 = 1, c = 3 ≤ r = 4 → BP = exp(1 − 4/3) = exp(−1/3)
        ("new york city", "new york city usa", math.exp(-1 / 3)),
        # c = 5 > r = 4 → BP = 1; p1..p4 = 4/5, 3/4, 2/3, 1/2 → (1/5)^(1/4)
        ("a b c d e", "a b c d", 0.2**0.25),
        # clipping: c = 6, r = 4, BP = 1; p1 = (2+2)/6, p2 = (2+1)/5, p3 = (1+1)/4,
        # p4 = (1+0)/3 → (4/6 · 3/5 · 2/4 · 1/3)^(1/4) = (1/15)^(1/4)
        ("a b a b a b", "a b a b", (1 / 15) ** 0.25),
        # c = 2 < r = 3, p1 = p2 = 1 → BP = exp(1 − 3/2)
        ("a a", "a a a", math.exp(-0.5)),
        # no prediction tokens → 0
        ("", "paris", 0.0),
    ],
)
def test_hand_computed(pred, ref, expected):
    assert short_form_bleu_tokens(pred.split(), ref.split()) == pytest.approx(expected, abs=1e-12)


def test_tokens_are_not_normalised():
    assert short_form_bleu_tokens(["Paris"], ["paris"]) == 0.0
    assert short_form_bleu_tokens(["paris."], ["paris"]) == 0.0


def test_text_version_normalises_and_takes_max_over_golds():
    # "The Eiffel Tower." → ["eiffel", "tower"] = the first gold
    assert short_form_bleu("The Eiffel Tower.", ["eiffel tower", "paris"]) == 1.0
    # best gold: [new york city] vs [new york city usa] = exp(−1/3); "London" scores 0
    assert short_form_bleu("New York City!", ["London", "New York City, USA"]) == pytest.approx(
        math.exp(-1 / 3), abs=1e-12
    )
    assert short_form_bleu("Paris", "paris") == 1.0


def test_text_version_empty_and_missing_predictions_score_zero():
    assert short_form_bleu(None, ["paris"]) == 0.0
    assert short_form_bleu("", ["paris"]) == 0.0
    assert short_form_bleu("The", ["paris"]) == 0.0  # normalises to no tokens


def test_text_version_rejects_empty_golds():
    with pytest.raises(ValueError, match="golds"):
        short_form_bleu("paris", [])


tokens = st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=8)


@PROPERTY
@given(tokens, tokens)
def test_bleu_in_unit_interval(pred, ref):
    score = short_form_bleu_tokens(pred, ref)
    assert 0.0 <= score <= 1.0


@PROPERTY
@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=10))
def test_identical_nonempty_scores_one(pred):
    assert short_form_bleu_tokens(pred, list(pred)) == 1.0


@PROPERTY
@given(tokens, tokens)
def test_invariant_under_renaming_tokens(pred, ref):
    rename = {"a": "w", "b": "x", "c": "y", "d": "z"}
    renamed = short_form_bleu_tokens([rename[t] for t in pred], [rename[t] for t in ref])
    assert renamed == short_form_bleu_tokens(pred, ref)


@PROPERTY
@given(tokens, tokens)
def test_nonzero_short_prediction_is_a_substring_of_the_reference(pred, ref):
    # For c ≤ 4 the top order n = c has one n-gram: the whole prediction.
    if 1 <= len(pred) <= 4 and short_form_bleu_tokens(pred, ref) > 0:
        assert any(ref[i : i + len(pred)] == pred for i in range(len(ref)))


@PROPERTY
@given(model_text, st.text(max_size=30))
def test_text_version_never_raises_and_is_bounded(prediction, gold):
    assert 0.0 <= short_form_bleu(prediction, [gold, "paris"]) <= 1.0


@PROPERTY
@given(st.text(max_size=40))
def test_text_version_identical_strings_score_one(text):
    # an answer that normalises to no tokens has c = 0 → 0
    expected = 1.0 if normalize_answer(text) else 0.0
    assert short_form_bleu(text, text) == expected


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_text_version_adversarial(text):
    assert 0.0 <= short_form_bleu(text, ["paris"]) <= 1.0
