"""Progressive Reward Shaping (SPEC §7; prs_vspo.txt eq. 8–15)."""

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from agentrl.rewards import (
    prs_format_reward,
    prs_general,
    prs_long,
    prs_process_from_flags,
    prs_process_reward,
    prs_short,
    prs_short_components,
)
from tests import spec_examples
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text

PRS_FUNCTIONS = {"prs_short": prs_short, "prs_long": prs_long, "prs_general": prs_general}


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("case", spec_examples.load()["prs"]["cases"])
def test_spec_examples(case):
    result = PRS_FUNCTIONS[case["fn"]](*case["args"])
    assert isinstance(result, float)
    assert result == pytest.approx(case["expected"], abs=1e-12)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((-1, 0, 0.9), -1.0),  # process < 1: answer ignored, −1 + 0
        ((0, 0.1, 0.9), 0.1),  # process < 1: 0 + 0.1
        ((1, 0.1, 0.5), 1.6),  # process = 1: 1 + 0.1 + 0.5
        ((1, 0.0, 0.0), 1.0),
    ],
)
def test_prs_short_hand_computed(args, expected):
    assert prs_short(*args) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 0.1, 1, 1), 0.1),  # process < 1: judge and answer ignored
        ((1, 0.1, 0, 1), 1.1),  # judge < 1: 1 + 0.1 + 0, answer gated off
        ((1, 0.1, 1, 0.4), 2.5),  # judge ≥ 1: 1 + 0.1 + 1 + 0.4
        ((1, 0.1, 0.99, 1.0), 2.09),  # judge below the gate still adds itself
        ((-1, 0.0, 1, 1), -1.0),
    ],
)
def test_prs_long_hand_computed(args, expected):
    assert prs_long(*args) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("stages", "thresholds", "expected"),
    [
        # 1 + σ(0.5) + σ(2): both gates pass (1 ≥ 1, 0.5 ≥ 0.4)
        ([1.0, 0.5, 2.0], [1.0, 0.4], 1 + sigmoid(0.5) + sigmoid(2.0)),
        ([0.5, 3.0], [1.0], 0.5),  # gate 1 fails: 0.5 < 1
        ([1.0, 0.0, 2.0], [1.0, 0.5], 1.5),  # 1 + σ(0) = 1.5; gate 2 fails: 0 < 0.5
        ([2.0], [], 2.0),  # one stage: R_1
        # thresholds compare raw R_i: R_2 = −3 ≥ ε_2 = −5 passes although σ(−3) ≈ 0.047
        ([0.0, -3.0, 1.0], [0.0, -5.0], sigmoid(-3.0) + sigmoid(1.0)),
        # a later gate cannot reopen after an earlier one closed
        ([0.0, 0.0, 9.0, 9.0], [1.0, -1.0, -1.0], 0.0),
    ],
)
def test_prs_general_hand_computed(stages, thresholds, expected):
    assert prs_general(stages, thresholds) == pytest.approx(expected, abs=1e-12)


def test_prs_general_large_values_are_finite():
    assert prs_general([1.0, -1e4, 1e4], [0.0, -1e5]) == pytest.approx(2.0, abs=1e-12)


def test_prs_general_bad_thresholds_raise_with_fix():
    with pytest.raises(ValueError, match=r"thresholds has 1 entries .* pass len\(stages\) - 1 = 2"):
        prs_general([1.0, 0.5, 2.0], [1.0])
    with pytest.raises(ValueError, match="stages is empty"):
        prs_general([], [])


def test_elementwise_numpy():
    out = prs_short(np.array([-1.0, 0.0, 1.0]), 0.1, np.array([0.9, 0.9, 0.5]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [-0.9, 0.1, 1.6])
    out = prs_long(np.array([0, 1, 1]), 0.1, np.array([1, 0, 1]), np.array([1, 1, 0.4]))
    np.testing.assert_allclose(out, [0.1, 1.1, 2.5])
    r1 = np.array([1.0, 0.5, 1.0])
    out = prs_general([r1, np.array([0.5, 3.0, 0.0]), 2.0], [1.0, np.array([0.4, 0.4, 0.5])])
    np.testing.assert_allclose(
        out, [1 + sigmoid(0.5) + sigmoid(2.0), 0.5, 1.5], atol=1e-12
    )


stage = st.floats(-5.0, 5.0)


@PROPERTY
@given(st.lists(stage, min_size=2, max_size=5), st.data())
def test_prs_general_monotone_in_later_stages_once_gates_pass(stages, data):
    thresholds = [s - 1.0 for s in stages[:-1]]  # every gate passes
    k = data.draw(st.integers(1, len(stages) - 1))
    bump = data.draw(st.floats(0.01, 1.0))
    # raising R_k keeps its own gate passing, so only σ(R_k) changes, upward
    higher = [*stages[:k], stages[k] + bump, *stages[k + 1 :]]
    assert prs_general(higher, thresholds) > prs_general(stages, thresholds)


@PROPERTY
@given(st.lists(stage, min_size=2, max_size=5), st.data())
def test_prs_general_passing_one_more_gate_adds_reward(stages, data):
    m = len(stages)
    k = data.draw(st.integers(1, m - 1))  # gates 1..k−1 pass; compare gate k closed vs open
    passing = [s - 1.0 for s in stages[: k - 1]]
    closed = [*passing, stages[k - 1] + 1.0, *([0.0] * (m - 1 - k))]
    opened = [*passing, stages[k - 1] - 1.0, *([0.0] * (m - 1 - k))]
    assert prs_general(stages, opened) > prs_general(stages, closed)


@PROPERTY
@given(st.floats(0.0, 0.1), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from([-1.0, 0.0]))
def test_prs_short_completing_the_process_always_pays(fmt, answer, answer_other, process_low):
    # R_process ∈ {−1, 0, 1}: a complete process (≥ 1) beats an incomplete one (≤ 0 + 0.1)
    assert prs_short(1.0, 0.0, answer) > prs_short(process_low, 0.1, answer_other)
    # and once the process is complete, the answer adds
    assert prs_short(1.0, fmt, answer) == pytest.approx(1.0 + fmt + answer)


@PROPERTY
@given(st.floats(0.0, 0.1), st.floats(1.0, 3.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_prs_long_monotone_in_answer_after_both_gates(fmt, judge, answer, bump):
    assert prs_long(1.0, fmt, judge, answer + bump) >= prs_long(1.0, fmt, judge, answer)


# ---- text-side stage rewards (eq. 8–9) ----

def tool_step(*calls):
    body = json.dumps(list(calls) if len(calls) != 1 else calls[0])
    return f"<reasoning>I should search.</reasoning>\n<tool_call>{body}</tool_call>"


CALL = {"name": "wiki_search", "arguments": {"query": "capital of France"}}
FINAL = "<reasoning>The documents say Paris.</reasoning>\n<answer>Paris</answer>"


def test_process_from_flags():
    assert prs_process_from_flags(True, True) == 1.0
    assert prs_process_from_flags(True, False) == 0.0
    assert prs_process_from_flags(False, True) == -1.0
    assert prs_process_from_flags(False, False) == -1.0


@pytest.mark.parametrize(
    ("steps", "kwargs", "expected"),
    [
        ([tool_step(CALL), FINAL], {}, 1.0),
        ([FINAL], {}, 1.0),  # direct answer: no tool call to fail
        ([tool_step(CALL, CALL), tool_step(CALL), FINAL], {}, 1.0),
        # truncated: last step is another call, no answer → 0
        ([tool_step(CALL), tool_step(CALL)], {}, 0.0),
        # unparseable call JSON → −1 even though the answer parses
        (["<reasoning>r</reasoning><tool_call>{oops</tool_call>", FINAL], {}, -1.0),
        # call without "arguments" → −1
        (['<tool_call>{"name": "wiki_search"}</tool_call>', FINAL], {}, -1.0),
        # intermediate step with no tool call at all → −1
        (["<reasoning>thinking only</reasoning>", FINAL], {}, -1.0),
        # an unclosed tool call in the final step → −1
        ([tool_step(CALL), FINAL + '<tool_call>{"name": "x"'], {}, -1.0),
        # execution flags: one per parsed call over the trajectory
        ([tool_step(CALL, CALL), FINAL], {"call_success": [True, True]}, 1.0),
        ([tool_step(CALL, CALL), FINAL], {"call_success": [True, False]}, -1.0),
        ([tool_step(CALL, CALL), FINAL], {"call_success": [True]}, -1.0),  # missing flag
        ([], {}, -1.0),
    ],
)
def test_process_reward(steps, kwargs, expected):
    assert prs_process_reward(steps, **kwargs) == expected


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([tool_step(CALL), FINAL], 0.1),
        ([FINAL], 0.1),
        (["\n <reasoning>r</reasoning>\n\n<tool_call>{}</tool_call>\n<tool_call>x</tool_call> ",
          FINAL], 0.1),  # bad JSON is R_process's business, not R_format's
        ([tool_step(CALL), "The answer is Paris."], 0.0),  # untagged final step
        ([tool_step(CALL), "Sure! " + FINAL], 0.0),  # text outside the tags
        (["<tool_call>{}</tool_call>", FINAL], 0.0),  # no reasoning
        (["<tool_call>{}</tool_call><reasoning>r</reasoning>", FINAL], 0.0),  # wrong order
        ([tool_step(CALL) + "<answer>Paris</answer>", FINAL], 0.0),  # answer in a tool step
        ([tool_step(CALL)], 0.0),  # no final answer step
        (["<reasoning>a <reasoning> b</reasoning>" + FINAL[FINAL.index("\n"):]], 0.0),  # nested
        (["<reasoning>r</reasoning><answer>a</answer><answer>b</answer>"], 0.0),  # two answers
        (["<reasoning>r</reasoning><answer>a</answer></answer>"], 0.0),  # stray closing tag
        ([], 0.0),
    ],
)
def test_format_reward(steps, expected):
    assert prs_format_reward(steps) == expected


def test_custom_tags():
    steps = ["<think>t</think><tool_call>{}</tool_call>", "<think>t</think><ans>x</ans>"]
    assert prs_format_reward(steps, reasoning_tag="think", answer_tag="ans") == 0.1
    assert prs_format_reward(steps) == 0.0


def test_short_components_chain_the_stages():
    parts = prs_short_components([tool_step(CALL), FINAL], ["Paris"])
    # process 1, format 0.1, BLEU([paris], [paris]) = 1 → 1 + 0.1 + 1
    assert parts == {"process": 1.0, "format": 0.1, "answer": 1.0, "total": pytest.approx(2.1)}
    final = "<reasoning>r</reasoning><answer>New York City</answer>"
    parts = prs_short_components([final], ["new york city usa"])
    # BLEU = exp(1 − 4/3) (see test_bleu); total 1 + 0.1 + exp(−1/3)
    assert parts["total"] == pytest.approx(1.1 + math.exp(-1 / 3), abs=1e-12)
    # incomplete process: answer reward computed but gated off
    parts = prs_short_components(["<reasoning>r</reasoning>", FINAL], ["Paris"])
    assert (parts["process"], parts["answer"], parts["total"]) == (-1.0, 1.0, -1.0)


def test_step_texts_must_be_a_list():
    with pytest.raises(ValueError, match="step_texts"):
        prs_process_reward(FINAL)
    with pytest.raises(ValueError, match="step_texts"):
        prs_format_reward(FINAL)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_stage_rewards_adversarial(text):
    assert prs_process_reward([text, text]) in (-1.0, 0.0, 1.0)
    assert prs_format_reward([text]) in (0.0, 0.1)
    parts = prs_short_components([text], ["paris"])
    assert -1.0 <= parts["total"] <= 2.1


@PROPERTY
@given(st.lists(model_text, max_size=4), st.lists(st.booleans(), max_size=4))
def test_stage_rewards_never_raise(steps, flags):
    assert prs_process_reward(steps, call_success=flags) in (-1.0, 0.0, 1.0)
    assert prs_format_reward(steps) in (0.0, 0.1)
    assume(steps)
    parts = prs_short_components(steps, ["paris"])
    assert parts["total"] == pytest.approx(prs_short(parts["process"], parts["format"],
                                                     parts["answer"]))
