"""PORTool format score (SPEC §6.4; portool_rewarded_tree.txt §3.2)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.rewards import portool_format_score, portool_format_score_from_flags
from tests import spec_examples
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text

CALL = {"name": "weather_search", "arguments": {"start_datetime": "@D7pmH"}}
THINK = "<think> The user asks for the weather at 7 PM. </think>\n"


def step(payload, think=THINK):
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"{think}<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize("case", spec_examples.load()["portool_format"]["cases"])
def test_spec_examples(case):
    assert portool_format_score_from_flags(**case["inputs"]) == pytest.approx(
        case["expected"], abs=1e-9
    )


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        (THINK, [], 0.2),  # think only
        (step("not json"), [True], 0.2 + 0.1),  # tags, JSON fails
        (step({"name": "x"}), [True], 0.2 + 0.1 + 0.1),  # no "arguments"
        (step({"name": "x", "arguments": "{}"}), [True], 0.4),  # arguments not a dict
        (step([]), [], 0.4),  # valid JSON, but no call to carry the fields
        (step("42"), [True], 0.3),  # scalar JSON is not a call or a list of calls
        (step([CALL]), [True], 1.0),  # 0.2 + 0.1 + 0.1 + 0.05 + 0.55 · 1/1
        (step(CALL), [False], 0.45),  # one call object, failed: 0.45 + 0.55 · 0
        (step([CALL, CALL]), [True, False], 0.45 + 0.55 / 2),  # = 0.725
        (step([CALL, CALL, CALL]), [True, True, False], 0.45 + 0.55 * 2 / 3),
        (step([CALL]), [True], 1.0),
        (step([CALL], think=""), [True], 0.0),  # no think: nothing counts
        ("<think>t</think>" + step(CALL, think="") + step(CALL, think=""), [True, True], 1.0),
        # several blocks: every block must parse
        ("<think>t</think>" + step(CALL, think="") + step("oops", think=""), [True], 0.3),
    ],
)
def test_text_hand_computed(text, flags, expected):
    assert portool_format_score(text, flags) == pytest.approx(expected, abs=1e-12)


def test_call_success_length_mismatch_never_raises():
    two = step([CALL, CALL])
    # missing flags count as failures: 1 success of 2 calls
    assert portool_format_score(two, [True]) == pytest.approx(0.725)
    assert portool_format_score(two, []) == pytest.approx(0.45)
    assert portool_format_score(two, None) == pytest.approx(0.45)
    # extra flags are ignored: the first two are [True, False]
    assert portool_format_score(two, [True, False, True, True]) == pytest.approx(0.725)


def test_stray_tags_next_to_complete_blocks_do_not_change_the_score():
    assert portool_format_score(step([CALL]) + "<tool_call>", [True]) == 1.0


def test_from_flags_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n_success"):
        portool_format_score_from_flags(1, 1, 1, 1, 2, 3)
    with pytest.raises(ValueError, match="n_calls"):
        portool_format_score_from_flags(1, 1, 1, 1, -1, 0)


flags = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())
CAPS = [0.0, 0.2, 0.3, 0.4]  # the score when criterion i is the first to fail


@PROPERTY
@given(flags, st.integers(0, 6), st.data())
def test_from_flags_range_and_gate_ordering(criteria, n_calls, data):
    n_success = data.draw(st.integers(0, n_calls))
    score = portool_format_score_from_flags(*criteria, n_calls, n_success)
    assert 0.0 <= score <= 1.0 + 1e-12
    if all(criteria):
        assert score >= 0.45 - 1e-12
        return
    first_failed = criteria.index(False)
    assert score == pytest.approx(CAPS[first_failed])
    # once a criterion fails, the later ones and the success count cannot change the score
    later = data.draw(st.tuples(*[st.booleans()] * (3 - first_failed)))
    changed = (*criteria[: first_failed + 1], *later)
    assert portool_format_score_from_flags(*changed, n_calls, n_calls) == score


@PROPERTY
@given(st.integers(1, 8), st.data())
def test_from_flags_monotone_in_successes(n_calls, data):
    k = data.draw(st.integers(0, n_calls - 1))
    assert (portool_format_score_from_flags(1, 1, 1, 1, n_calls, k + 1)
            > portool_format_score_from_flags(1, 1, 1, 1, n_calls, k))


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_text_adversarial(text):
    score = portool_format_score(text, [True] * 3)
    assert 0.0 <= score <= 1.0


@PROPERTY
@given(model_text, st.lists(st.booleans(), max_size=5))
def test_text_never_raises_and_respects_gates(text, call_flags):
    score = portool_format_score(text, call_flags)
    assert 0.0 <= score <= 1.0 + 1e-12
    assert score in (0.0, 0.2) or score == pytest.approx(0.3) or score >= 0.4 - 1e-12
    if "</think>" not in text:
        assert score == 0.0
    if "</tool_call>" not in text:
        assert score <= 0.2
