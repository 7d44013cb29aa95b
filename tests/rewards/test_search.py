"""MT-PPO search-agent rewards (SPEC §4; turn_level_credit_mt_grpo_mt_ppo.txt §5.2)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.rewards import (
    count_searches,
    mt_ppo_final_components,
    mt_ppo_final_format_ok,
    mt_ppo_final_reward,
    mt_ppo_intermediate_components,
    mt_ppo_intermediate_format_ok,
    mt_ppo_intermediate_reward,
    mt_ppo_trajectory_rewards,
)
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text

# The paper's correct MT-PPO rollout (App. B.3, Table 2), split into turns.
GOLDS = ["Charles, Prince of Wales"]
TURN_1 = (
    "<think>I need to find out who will take the throne after the queen dies. I'll search for "
    "it.</think> <search> who will take the throne after the queen dies </search> "
    "<information>Doc 1(Title: Succession to the British throne) Catholics are eligible. Queen "
    "Elizabeth II is the sovereign, and her ..</information>"
)
TURN_2 = (
    "<think>I found out that after the queen dies, her heir apparent will take the throne.</think>"
    " <search> heir apparent for Queen Elizabeth II </search> <information>Doc 1(Title: Heir "
    "apparent) rank behind her brothers regardless of their ages ...</information>"
)
FINAL = (
    "<think>I found out that the heir apparent for Queen Elizabeth II is her eldest son, Charles, "
    "Prince of Wales. Now I can provide the answer.</think> <answer> Charles, Prince of Wales "
    "</answer>"
)


def test_paper_rollout():
    intermediate, final = mt_ppo_trajectory_rewards([TURN_1, TURN_2, FINAL], GOLDS)
    # turn 1: retrieval 0 (answer not in docs) + format 0.1 − 0.1·1 search = 0
    # turn 2: 0 + 0.1 − 0.1·2 (cumulative) = −0.1
    assert intermediate == pytest.approx([0.0, -0.1], abs=1e-12)
    # EM 1 + format 0.2
    assert final == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>a</think><answer>b</answer>", True),
        ("Sure. <think>a</think>\n then <answer>b</answer> done", True),  # free text allowed
        ("<answer>b</answer><think>a</think>", False),  # order
        ("<think>a<answer>b</answer></think>", False),  # nested: think must close first
        ("<think>a</think><answer>b</answer><answer>c</answer>", False),  # twice
        ("<think>a</think><answer>b", False),  # unclosed
        ("<answer>b</answer>", False),  # no think
        ("<think>a</think><search>q</search><answer>b</answer>", False),  # extra tag
        ("<think>a</think><answer>b<br/></answer>", False),  # extra tag, self-closing
        ("<think id='1'>a</think><answer>b</answer>", False),  # attributes
        ("<think>a</think><answer>x < y</answer>", True),  # a bare "<" is not a tag
        ("", False),
    ],
)
def test_final_format(text, ok):
    assert mt_ppo_final_format_ok(text) is ok
    assert mt_ppo_final_components(text, "zzz")["format"] == (0.2 if ok else -1.0)


def test_final_em_uses_squad_normalisation_and_last_answer():
    assert mt_ppo_final_components("<think>t</think><answer> The Paris! </answer>", "paris") == {
        "em": 1.0, "format": 0.2, "total": 1.2
    }
    # bad format and a correct answer: 1 − 1 = 0
    assert mt_ppo_final_reward("<answer>paris</answer>", ["london", "paris"]) == 0.0
    # no answer block: EM 0, format −1
    assert mt_ppo_final_reward("paris", ["paris"]) == -1.0
    # last block is the answer: "paris" then "rome"
    text = "<think>t</think><answer>paris</answer> <answer>rome</answer>"
    assert mt_ppo_final_components(text, "rome")["em"] == 1.0


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>a</think><search>q</search><information>d</information>", True),
        # tags inside the retrieved documents are not the policy's
        ("<think>a</think><search>q</search><information>d <b>x</b> <answer></information>", True),
        ("<search>q</search><think>a</think><information>d</information>", False),  # order
        ("<think>a</think><search>q</search>", False),  # no information
        ("<think>a</think><search>q</search><search>r</search><information>d</information>",
         False),
        ("<think>a</think><answer>x</answer><search>q</search><information>d</information>",
         False),  # extra tag outside the documents
    ],
)
def test_intermediate_format(text, ok):
    assert mt_ppo_intermediate_format_ok(text) is ok
    assert mt_ppo_intermediate_components(text, "zzz", 0)["format"] == (0.1 if ok else -0.2)


def test_intermediate_components_hand_computed():
    text = ("<think>where?</think><search>capital of france</search>"
            "<information>Doc 1: PARIS is the capital.</information>")
    # retrieval 0.3 (case-insensitive) + format 0.1 − 0.1 · 3 searches so far
    parts = mt_ppo_intermediate_components(text, ["paris"], 3)
    assert parts["retrieval"] == 0.3
    assert parts["format"] == 0.1
    assert parts["search"] == pytest.approx(-0.3)
    assert parts["total"] == pytest.approx(0.1)
    assert mt_ppo_intermediate_reward(text, ["paris"], 3) == parts["total"]


def test_retrieval_looks_only_inside_information():
    text = "<think>paris?</think><search>paris</search><information>London</information>"
    assert mt_ppo_intermediate_components(text, ["paris"], 1)["retrieval"] == 0.0
    assert mt_ppo_intermediate_components(text, ["", "london"], 1)["retrieval"] == 0.3


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_num_searches_must_be_a_count(bad):
    with pytest.raises(ValueError, match="num_searches_so_far"):
        mt_ppo_intermediate_reward("x", ["y"], bad)


def test_trajectory_counts_searches_cumulatively():
    two_searches = (
        "<think>t</think><search>a</search><search>b</search><information>d</information>"
    )
    assert count_searches(two_searches) == 2
    intermediate, final = mt_ppo_trajectory_rewards([two_searches, TURN_1, FINAL], GOLDS)
    # turn 1: bad format (two searches) −0.2 − 0.1·2; turn 2: 0.1 − 0.1·3
    assert intermediate == pytest.approx([-0.4, -0.2])
    assert final == pytest.approx(1.2)
    assert mt_ppo_trajectory_rewards([FINAL], GOLDS) == ([], pytest.approx(1.2))


def test_trajectory_needs_turns():
    with pytest.raises(ValueError, match="turn_texts"):
        mt_ppo_trajectory_rewards([], GOLDS)
    with pytest.raises(ValueError, match="turn_texts"):
        mt_ppo_trajectory_rewards(FINAL, GOLDS)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_adversarial(text):
    assert mt_ppo_final_reward(text, ["paris"]) in (-1.0, 0.0, 0.2, 1.2)
    parts = mt_ppo_intermediate_components(text, ["paris"], 1)
    assert parts["retrieval"] in (0.0, 0.3) and parts["format"] in (0.1, -0.2)


@PROPERTY
@given(model_text, st.integers(0, 10))
def test_never_raise_and_value_sets(text, n_search):
    assert mt_ppo_final_reward(text, ["paris"]) in (-1.0, 0.0, 0.2, 1.2)
    parts = mt_ppo_intermediate_components(text, ["paris"], n_search)
    assert parts["retrieval"] in (0.0, 0.3)
    assert parts["format"] in (0.1, -0.2)
    assert parts["search"] == pytest.approx(-0.1 * n_search)
    assert parts["total"] == pytest.approx(parts["retrieval"] + parts["format"] + parts["search"])


@PROPERTY
@given(st.lists(model_text, min_size=1, max_size=4))
def test_trajectory_never_raises(turns):
    intermediate, final = mt_ppo_trajectory_rewards(turns, "paris")
    assert len(intermediate) == len(turns) - 1
    assert final in (-1.0, 0.0, 0.2, 1.2)
