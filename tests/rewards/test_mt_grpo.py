"""MT-GRPO two-turn rewards (SPEC §4; turn_level_credit_mt_grpo_mt_ppo.txt App. D.2)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.rewards import (
    mt_grpo_answer_presence_reward,
    mt_grpo_exact_match_reward,
    mt_grpo_outcome_components,
    mt_grpo_outcome_reward,
    mt_grpo_search_answer_reward,
    mt_grpo_tool_execution_reward,
    mt_grpo_turn_components,
    mt_grpo_turn_reward,
    mt_grpo_xml_format_reward,
    mt_grpo_xml_format_score,
    mt_grpo_xml_tag_usage_reward,
    mt_grpo_xml_tag_usage_score,
)
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text

# The paper's successful rollout (App. D.6, Table 5).
GACY = ["John Wayne Gacy"]
M1 = (
    '<reasoning> To find out who was the serial killer known as the "Killer Clown," we\'ll use '
    "the wiki_search tool. </reasoning>\n<tool>\n{\n"
    '    "name": "wiki_search",\n    "args": {"query": "Killer Clown serial killer"}\n}\n</tool>'
)
ENV = "<result>\nJohn Wayne Gacy. John Wayne Gacy (March 17, 1942 – May 10, 1994) ...\n</result>"
M2 = "<reasoning> From the information ... </reasoning>\n\n<answer> John Wayne Gacy </answer>"

# The paper's malformed rollout (Table 7).
PETERSON = ["Oscar Peterson"]
BAD_1 = "<reasoning> I need to identify the Canadian jazz pianist ... </re>"
BAD_ENV = "Error: Tool command not found or invalid XML format. Please ensure correct formatting."
BAD_2 = (
    "<answer><tool>< reasoning> From the Wikipedia search I found that Oscar Peterson ... "
    "</reasoning><answer>Oscar Peterson</answer></result><answer>Oscar Peterson</a>"
)


def test_paper_successful_rollout():
    # turn: tool executed 0.2 + "john wayne gacy" in the result 0.5
    assert mt_grpo_turn_components(M1, ENV, GACY) == {
        "tool_execution": 0.2, "search_answer": 0.5, "total": 0.7
    }
    # outcome: presence 0.5 + EM 1.0 + format 0.2·1 + tag usage 0.2·1
    parts = mt_grpo_outcome_components([M1, M2], GACY)
    assert parts == pytest.approx({
        "answer_presence": 0.5, "exact_match": 1.0, "xml_format": 0.2, "xml_tag_usage": 0.2,
        "total": 1.9,
    })


def test_paper_malformed_rollout():
    # no complete <tool> block in the first message and the env answered "Error:"
    assert mt_grpo_turn_reward(BAD_1, BAD_ENV, PETERSON) == 0.0
    # BAD_1 format: presence 0 (no complete field) + spacing 0.2 + start 0.2 + end 0 = 0.4
    assert mt_grpo_xml_format_score(BAD_1) == pytest.approx(0.4)
    # BAD_2 format: presence 0.4·1/2 (only <answer>) + spacing 0 ("< reasoning>")
    #   + start 0 + end 0 ("</a>") = 0.2
    assert mt_grpo_xml_format_score(BAD_2) == pytest.approx(0.2)
    # tag usage: BAD_1 checks reasoning (1 open, 0 close) → 0/1; BAD_2 checks reasoning (0, 1),
    # tool (1, 0), answer (3, 1) → 0/3
    assert mt_grpo_xml_tag_usage_score(BAD_1) == 0.0
    assert mt_grpo_xml_tag_usage_score(BAD_2) == 0.0
    # outcome: the last answer block is "Oscar Peterson" → 0.5 + 1.0;
    # format 0.2 · (0.4 + 0.2)/2 = 0.06; tag usage 0
    assert mt_grpo_outcome_reward([BAD_1, BAD_2], PETERSON) == pytest.approx(1.56)


def test_paper_direct_answer_without_tool():
    # Table 6: answered "Giant" without calling the tool
    message = "<reasoning> In the film ... giant ants. </reasoning>\n\n<answer> Giant </answer>"
    assert mt_grpo_turn_reward(message, None, ["giant ants"]) == 0.0
    # "giant ants" not in "Giant": presence 0, EM 0; format 0.2 · 1; tag usage 0.2 · 1
    assert mt_grpo_outcome_reward([message], ["giant ants"]) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (ENV, 0.2),
        ("plain tool output", 0.2),
        ("<result>\nError: unknown tool\n</result>", 0.0),  # error wrapped in <result>
        ("  Error: bad JSON", 0.0),
        ("<result> </result>", 0.0),  # empty output
        ("", 0.0),
        (None, 0.0),  # environment not invoked
    ],
)
def test_tool_execution(env, expected):
    assert mt_grpo_tool_execution_reward(M1, env) == expected


def test_tool_execution_needs_a_tool_block():
    assert mt_grpo_tool_execution_reward("<reasoning>r</reasoning>", ENV) == 0.0
    assert mt_grpo_tool_execution_reward("<tool>{}", ENV) == 0.0


def test_search_answer_presence():
    assert mt_grpo_search_answer_reward(M1, "<result>JOHN WAYNE GACY was</result>", GACY) == 0.5
    assert mt_grpo_search_answer_reward(M1, "<result>Ted Bundy</result>", GACY) == 0.0
    # an error reply echoing the answer is not a search result
    assert mt_grpo_search_answer_reward(M1, "Error: John Wayne Gacy not found", GACY) == 0.0
    assert mt_grpo_search_answer_reward("no tool", ENV, GACY) == 0.0


def test_answer_presence_and_exact_match():
    final = ["<reasoning>r</reasoning><answer>The Beatles.</answer>"]
    # presence is a case-insensitive substring test
    assert mt_grpo_answer_presence_reward(final, ["beatles"]) == 0.5
    # EM only lowercases and strips: article and punctuation count
    assert mt_grpo_exact_match_reward(final, ["beatles"]) == 0.0
    assert mt_grpo_exact_match_reward(final, ["the beatles."]) == 1.0
    assert mt_grpo_exact_match_reward(["<answer>  JOHN wayne GACY \n</answer>"], GACY) == 1.0
    # the final response is the last message: an earlier answer does not count
    assert mt_grpo_answer_presence_reward(["<answer>beatles</answer>", "no answer"],
                                          ["beatles"]) == 0.0
    assert mt_grpo_exact_match_reward([], ["beatles"]) == 0.0


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # presence 0.4 + spacing 0.2 + start 0.2 + end 0.2
        ("<reasoning>r</reasoning><tool>{}</tool>", 1.0),
        ("\n <reasoning> r </reasoning>\n<answer> a </answer>\n", 1.0),  # content spaces are fine
        # presence 0.4·1/2 + spacing 0.2 + start 0.2 + end 0
        ("<reasoning>r</reasoning>", 0.6),
        # presence 0.4·1/2 + spacing 0.2 + start 0 + end 0.2
        ("<answer>a</answer>", 0.6),
        # presence 0.4·1/2 ("</answer >" closes no block) + spacing 0 + start 0.2 + end 0
        ("<reasoning>r</reasoning><answer>a</answer >", 0.4),
        # "< reasoning>": not a block, a spacing error, and not a start tag; end 0.2
        ("< reasoning>r</reasoning><tool>{}</tool>", 0.4 * 1 / 2 + 0.2),
        # no field, spacing vacuously fine, no start, no end
        ("hello", 0.2),
        ("", 0.2),
    ],
)
def test_xml_format_score(message, expected):
    assert mt_grpo_xml_format_score(message) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("<reasoning>r</reasoning><tool>{}</tool>", 1.0),
        ("<reasoning>r</reasoning><answer>a</answer><answer>", 0.5),  # answer: 2 opens
        ("<reasoning>r</reasoning><answer>a", 0.5),  # answer: no close
        ("<reasoning>r</reasoning></reasoning><tool></tool><answer></answer>", 2 / 3),
        ("no tags", 0.0),
    ],
)
def test_xml_tag_usage_score(message, expected):
    assert mt_grpo_xml_tag_usage_score(message) == pytest.approx(expected)


def test_xml_rewards_average_over_messages_and_scale():
    messages = ["<reasoning>r</reasoning><tool>{}</tool>", "<reasoning>r</reasoning>"]
    # format 0.2 · (1.0 + 0.6)/2 = 0.16; tag usage 0.2 · (1 + 1)/2 = 0.2
    assert mt_grpo_xml_format_reward(messages) == pytest.approx(0.16)
    assert mt_grpo_xml_tag_usage_reward(messages) == pytest.approx(0.2)
    assert mt_grpo_xml_format_reward([]) == 0.0


def test_messages_must_be_a_list():
    with pytest.raises(ValueError, match="assistant_messages"):
        mt_grpo_outcome_reward(M2, GACY)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_adversarial(text):
    assert mt_grpo_turn_reward(text, text, ["paris"]) in (0.0, 0.2, 0.7)
    assert 0.0 <= mt_grpo_outcome_reward([text, text], ["paris"]) <= 1.9 + 1e-12


@PROPERTY
@given(model_text, st.one_of(st.none(), model_text), st.lists(model_text, max_size=3))
def test_never_raise_and_ranges(turn, env, messages):
    assert mt_grpo_turn_reward(turn, env, "paris") in (0.0, 0.2, 0.7)
    parts = mt_grpo_outcome_components([turn, *messages], "paris")
    assert parts["answer_presence"] in (0.0, 0.5)
    assert parts["exact_match"] in (0.0, 1.0)
    assert 0.0 <= parts["xml_format"] <= 0.2 + 1e-12
    assert 0.0 <= parts["xml_tag_usage"] <= 0.2 + 1e-12
    # exact match implies presence
    assert parts["exact_match"] == 0.0 or parts["answer_presence"] == 0.5
