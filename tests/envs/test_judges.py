"""Checklist judge (App. A.1.4), rule judges and PORTool's outcome evaluator over real HTTP."""

import json
import re

import pytest

from agentrl.envs.chat_client import ChatClient, ChatClientError
from agentrl.envs.judges import (
    CHECKLIST_JUDGE_PROMPT,
    ChecklistItem,
    ChecklistJudge,
    OutcomeEvaluator,
    RuleJudge,
    answer_contains,
    answer_equals,
    answer_matches,
    final_answer,
    format_messages,
    tool_called,
    tool_calls_in,
    tool_output_contains,
)
from tests.envs.scripted_llm import Reply, ScriptedLLMServer, last_user_content

# ---------------------------------------------------------------------------------------------
# A turn of a CM2-style dialogue and its checklist (the paper's item JSON, App. A.1.1).
# ---------------------------------------------------------------------------------------------

PREVIOUS = [{"role": "user", "content": "Hi, I am planning a trip."},
            {"role": "assistant", "content": "Happy to help with your trip."}]
USER = {"role": "user", "content": "Will it rain in Paris tomorrow?"}
STEP_0 = [
    USER,
    {"role": "assistant", "content": "<think>Check the forecast.</think>", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1.0}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"forecast": "rain", "mm": 4}'},
]
STEP_1 = [{"role": "assistant",
           "content": "<think>It rains.</think>Yes, expect rain in Paris tomorrow (4 mm)."}]

ITEMS = [
    {"id": "C0", "question": "Did the assistant call get_weather for Paris?",
     "focus_on": "assistant.tool_calls",
     "pass_condition": "A get_weather call exists with keyword get_weather",
     "failure_examples": ["No tool call observed", "Wrong city"],
     "evidence": [{"turn": 1, "step": 0, "from": "assistant.tool_calls",
                   "snippet": "get_weather(city=Paris)"}],
     "required_for_next_turn": True, "weight": 0.3},
    {"id": "C1", "question": "Did the assistant get the forecast from the tool?",
     "focus_on": "tool.content", "pass_condition": "The tool returns keyword forecast",
     "failure_examples": ["No tool response observed"], "evidence": [], "weight": 0.3},
    {"id": "C2", "question": "Does the final reply say it will rain?",
     "focus_on": "assistant.content.user_visible_reply",
     "pass_condition": "The reply mentions keyword expect",
     "failure_examples": ["Reply does not mention rain"], "evidence": "Yes, expect rain",
     "dependency": ["C1"], "weight": 0.4},
]

VERDICT_KEYS = ("high_level_understanding_of_the_question", "analysis_of_if_focus_on",
                "analysis_of_pass_condition", "analysis_of_failure_examples")


def verdict(answer):
    return {**{key: "scripted" for key in VERDICT_KEYS}, "answer": answer}


def current_section(prompt):
    return prompt.split("# Current Messages to Evaluate\n")[1].split("\n\n# Special rule")[0]


def keyword_judge(body):
    """Answers like a careful judge would here: an item passes iff its pass condition's
    keyword occurs in the Current Messages (never in the Previous ones)."""
    prompt = last_user_content(body)
    current = current_section(prompt)
    conditions = re.findall(r"(?:## Criterion (\w+)\n(?:.*\n){2})?Pass condition: .* keyword (\w+)",
                            prompt)
    if "## Criterion" in prompt:
        answer = {item: verdict(word in current) for item, word in conditions}
    else:
        answer = verdict(conditions[0][1] in current)
    return [json.dumps(answer)] * body["n"]


@pytest.fixture
def server():
    with ScriptedLLMServer() as server:
        yield server


def judge_for(server, **options):
    client = ChatClient(server.base_url, "judge", max_retries=0, timeout_s=5.0)
    return ChecklistJudge(client, **options)


# ---------------------------------------------------------------------------------------------
# Checklist judge
# ---------------------------------------------------------------------------------------------


def test_item_prompt_is_the_a14_prompt(server):
    server.add(Reply([json.dumps(verdict(True))]))
    judge = judge_for(server, batch_items=False)
    assert judge.judge(ITEMS[:1], STEP_0, PREVIOUS) == [True]
    body = server.received[0].body
    assert body["model"] == "judge" and body["temperature"] == 0.0 and body["n"] == 1
    prompt = last_user_content(body)
    expected = (CHECKLIST_JUDGE_PROMPT
                .replace("{question}", "Did the assistant call get_weather for Paris?")
                .replace("{focus_on}", "assistant.tool_calls")
                .replace("{pass_condition}", "A get_weather call exists with keyword get_weather")
                .replace("{failure_examples}", '["No tool call observed", "Wrong city"]')
                .replace("{reference_snippet}", "- [assistant.tool_calls] get_weather(city=Paris)")
                .replace("{messages_before}", format_messages(PREVIOUS))
                .replace("{messages_current}", format_messages(STEP_0)))
    assert prompt == expected
    assert prompt.startswith("# Role\nYou are a precise checklist evaluator. Your sole task is")
    assert prompt.endswith('"analysis_of_failure_examples": str,\n "answer": bool\n}')
    assert format_messages(STEP_0).splitlines()[2] == (
        '{"role": "tool", "tool_call_id": "c1", "content": "{\\"forecast\\": \\"rain\\", '
        '\\"mm\\": 4}"}')


@pytest.mark.parametrize("batch_items", [False, True])
def test_judge_reads_the_current_messages(server, batch_items):
    server.handler = keyword_judge
    judge = judge_for(server, batch_items=batch_items)
    assert judge.judge(ITEMS, STEP_0, PREVIOUS) == [True, True, False]
    assert judge.judge(ITEMS, STEP_0 + STEP_1, PREVIOUS) == [True, True, True]
    # Context before the turn is "Previous Messages", not evidence of this turn.
    assert judge.judge(ITEMS, [USER], PREVIOUS + STEP_0) == [False, False, False]
    stats = judge.stats
    assert stats.requests == (3 if batch_items else 9)
    assert stats.votes == 9 and stats.llm_items == 9 and stats.parse_failures == 0


def test_batched_prompt_lists_every_item(server):
    server.handler = keyword_judge
    judge_for(server).judge(ITEMS, STEP_0, PREVIOUS)
    prompt = last_user_content(server.received[0].body)
    assert [m for m in re.findall(r"## Criterion (\w+)", prompt)] == ["C0", "C1", "C2"]
    assert "whose keys are the criterion ids (C0, C1, C2)" in prompt
    assert "Reference snippet:\nYes, expect rain" in prompt


def test_judge_turn_gives_sat_after_per_step(server):
    server.handler = keyword_judge
    judge = judge_for(server, batch_items=False)
    rows = judge.judge_turn(ITEMS, [STEP_0, STEP_1], PREVIOUS)
    assert rows == [[True, True, False], [True, True, True]]
    assert judge.stats.requests == 4  # C0 and C1 are not asked again at step 1
    raw = judge_for(server, batch_items=False).judge_turn(
        ITEMS, [STEP_0, STEP_1], PREVIOUS, skip_satisfied=False)
    assert raw == rows


def test_majority_vote_over_k_samples(server):
    yes, no = json.dumps(verdict(True)), json.dumps(verdict(False))
    server.add(Reply([yes, no, yes]), Reply([yes, no, no]))
    judge = judge_for(server, samples=3, batch_items=False)
    assert judge.judge(ITEMS[:1], STEP_0) == [True]
    assert judge.judge(ITEMS[:1], STEP_0) == [False]
    assert [r.body["n"] for r in server.received] == [3, 3]
    assert server.received[0].body["temperature"] == 1.0
    assert judge.stats.votes == 6 and judge.stats.requests == 2


def test_a_tied_vote_is_not_satisfied(server):
    yes, no = json.dumps(verdict(True)), json.dumps(verdict(False))
    server.add(Reply([yes, no]), Reply([yes, no, yes, no]), Reply([yes, yes, yes, no]))
    assert judge_for(server, samples=2, batch_items=False).judge(ITEMS[:1], STEP_0) == [False]
    judge = judge_for(server, samples=4, batch_items=False)
    assert judge.judge(ITEMS[:1], STEP_0) == [False]
    assert judge.judge(ITEMS[:1], STEP_0) == [True]


def test_unparseable_verdicts_are_retried_then_count_as_failures(server):
    server.add(Reply(["I think it passes."]), Reply(['{"answer": tru']),
               Reply(['{"answer": "true"}']))
    judge = judge_for(server, batch_items=False, max_retries=2)
    assert judge.judge(ITEMS[:1], STEP_0) == [True]
    assert (judge.stats.requests, judge.stats.parse_failures, judge.stats.votes) == (3, 2, 1)

    server.add(*[Reply(['{"verdict": "yes"}'])] * 3)
    judge = judge_for(server, batch_items=False, max_retries=2)
    assert judge.judge(ITEMS[:1], STEP_0) == [False]
    stats = judge.stats
    assert (stats.requests, stats.parse_failures, stats.votes, stats.defaulted_votes) == (
        3, 3, 0, 1)


def test_missing_votes_count_against_the_item(server):
    yes, no = json.dumps(verdict(True)), json.dumps(verdict(False))
    server.add(Reply([yes, "garbage", yes]), Reply(["garbage"]))
    judge = judge_for(server, samples=3, batch_items=False, max_retries=1)
    # Two "yes" votes of three: satisfied even though one sample never parsed.
    assert judge.judge(ITEMS[:1], STEP_0) == [True]
    assert [r.body["n"] for r in server.received] == [3, 1]
    server.add(Reply([yes, "garbage", no]), Reply(["garbage"]))
    assert judge.judge(ITEMS[:1], STEP_0) == [False]  # 1 yes, 1 no, 1 missing (= no)
    stats = judge.stats
    assert (stats.votes, stats.parse_failures, stats.defaulted_votes) == (4, 4, 2)


def test_batch_retries_only_the_missing_items(server):
    server.add(Reply([json.dumps({"C0": verdict(True), "C2": {"answer": "maybe"}})]),
               Reply([json.dumps({"C1": verdict(True), "C2": verdict(False)})]))
    judge = judge_for(server)
    assert judge.judge(ITEMS, STEP_0) == [True, True, False]
    retry = last_user_content(server.received[1].body)
    assert re.findall(r"## Criterion (\w+)", retry) == ["C1", "C2"]
    assert judge.stats.parse_failures == 2 and judge.stats.requests == 2


def test_client_errors_default_to_false_or_raise(server):
    server.add(Reply(status=500))
    judge = judge_for(server)
    assert judge.judge(ITEMS[:2], STEP_0) == [False, False]
    assert judge.stats.client_errors == 1 and judge.stats.defaulted_votes == 2
    server.add(Reply(status=500))
    with pytest.raises(ChatClientError, match="HTTP 500"):
        judge_for(server, raise_on_client_error=True).judge(ITEMS[:1], STEP_0)


def test_rule_items_skip_the_llm(server):
    server.handler = keyword_judge
    items = [ChecklistItem.from_dict(ITEMS[0], rule=tool_called("get_weather", {"days": 1})),
             *ITEMS[1:]]
    judge = judge_for(server, rules={"C2": answer_contains("rain in paris")})
    assert judge.judge(items, STEP_0 + STEP_1) == [True, True, True]
    assert len(server.received) == 1
    prompt = last_user_content(server.received[0].body)
    assert re.findall(r"## Criterion (\w+)", prompt) == ["C1"]
    assert judge.stats.rule_items == 2 and judge.stats.llm_items == 1


def test_checklist_item_from_the_papers_json():
    item = ChecklistItem.from_dict(ITEMS[2])
    assert item.dependency == ("C1",) and item.weight == 0.4 and not item.strict
    assert ChecklistItem.from_dict(ITEMS[0]).strict
    assert item.reference_snippet() == "Yes, expect rain"
    with pytest.raises(ValueError, match="field 'question' must be a str"):
        ChecklistItem.from_dict({"id": "C9"})


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


HERMES_TURN = [
    USER,
    {"role": "assistant", "content": '<think>{"name": "ignored"}</think>\n<tool_call>\n'
                                     '{"name": "search", "arguments": {"query": "Paris rain", '
                                     '"k": 3}}\n</tool_call>'},
    {"role": "tool", "content": "Doc 1(Title: Paris) Rain expected."},
    {"role": "assistant", "content": "<tool_call>[{\"name\": \"response_gen\", \"arguments\": "
                                     "{\"response\": \"The Eiffel Tower is in Paris.\"}}]"
                                     "</tool_call>"},
]


def test_tool_calls_and_final_answer_extraction():
    assert tool_calls_in(STEP_0) == [("get_weather", {"city": "Paris", "days": 1.0})]
    assert tool_calls_in(HERMES_TURN) == [("search", {"query": "Paris rain", "k": 3}),
                                          ("response_gen",
                                           {"response": "The Eiffel Tower is in Paris."})]
    assert final_answer(HERMES_TURN) == "The Eiffel Tower is in Paris."
    assert final_answer(STEP_0 + STEP_1) == "Yes, expect rain in Paris tomorrow (4 mm)."
    assert final_answer([{"role": "assistant", "content": "<think>x</think><answer> 42 </answer>"}
                         ]) == "42"
    assert final_answer([USER]) == ""


@pytest.mark.parametrize("rule,expected", [
    (tool_called("get_weather"), True),
    (tool_called("get_weather", {"city": "Paris", "days": 1}), True),
    (tool_called("get_weather", {"city": "paris"}), False),
    (tool_called("get_weather", {"country": "FR"}), False),
    (tool_called("search"), False),
    (answer_contains("EXPECT RAIN"), True),
    (answer_contains("EXPECT RAIN", case_sensitive=True), False),
    (answer_contains("Check the forecast"), False),  # thinking is not the answer
    (answer_matches(r"\(\d+ mm\)"), True),
    (answer_equals(["yes"]), False),
    (tool_output_contains('"forecast": "RAIN"'), True),
    (tool_output_contains("sun"), False),
])
def test_rules(rule, expected):
    assert rule(STEP_0 + STEP_1, PREVIOUS) is expected


def test_rules_on_hermes_calls():
    assert tool_called("search", {"k": 3.0})(HERMES_TURN)
    assert answer_equals(["the eiffel tower is in paris"])(HERMES_TURN)
    assert not tool_called("ignored")(HERMES_TURN)


def test_rule_judge_interface_and_missing_rule():
    judge = RuleJudge({"C0": tool_called("get_weather"), "C1": tool_output_contains("forecast")})
    assert judge.judge(ITEMS[:2], STEP_0, PREVIOUS) == [True, True]
    assert judge.stats.rule_items == 2
    with pytest.raises(ValueError, match="checklist item 'C2' has no rule"):
        judge.judge(ITEMS, STEP_0)
    with pytest.raises(ValueError, match="is not a regex"):
        answer_matches("(")


# ---------------------------------------------------------------------------------------------
# PORTool outcome evaluator
# ---------------------------------------------------------------------------------------------


def judgement(label):
    return json.dumps({"reference_answer": "r", "analysis": "a", "judgement": label})


def evaluator_for(server, **options):
    return OutcomeEvaluator(ChatClient(server.base_url, "evaluator", max_retries=0), **options)


@pytest.mark.parametrize("label,reward", [
    ("true", 1.0), ("false", -1.0), ("unable_to_answer", 0.0), ("Unable to answer", 0.0)])
def test_outcome_labels(server, label, reward):
    server.add(Reply([judgement(label)]))
    verdict_ = evaluator_for(server).evaluate("Where is the Eiffel Tower?", HERMES_TURN[1:])
    assert verdict_.reward == reward
    assert verdict_.label == label.lower().replace(" ", "_")


def test_outcome_prompt_holds_query_trajectory_answer_and_reference(server):
    server.add(Reply([judgement("true")]))
    evaluator_for(server).evaluate("Where is the Eiffel Tower?", HERMES_TURN[1:],
                                   reference_answer="Paris")
    prompt = last_user_content(server.received[0].body)
    assert "# Query\nWhere is the Eiffel Tower?\n" in prompt
    assert "# Reference answer (from the dataset)\nParis\n" in prompt
    assert "# Final response\nThe Eiffel Tower is in Paris.\n" in prompt
    assert "Doc 1(Title: Paris) Rain expected." in prompt
    assert '"judgement": "true" | "false" | "unable_to_answer"' in prompt


def test_outcome_majority_and_ties(server):
    server.add(Reply([judgement(x) for x in
                      ["true", "false", "unable_to_answer", "true", "true"]]))
    evaluator = evaluator_for(server, samples=5)
    result = evaluator.evaluate("q", HERMES_TURN[1:])
    assert (result.reward, result.label) == (1.0, "true")
    assert result.votes == {"true": 3, "false": 1, "unable_to_answer": 1}
    assert server.received[0].body["n"] == 5

    server.add(Reply([judgement("true"), judgement("false"), "garbage", "garbage"]),
               Reply(["garbage"]), Reply(["garbage"]))
    tie = evaluator_for(server, samples=4, max_retries=2).evaluate("q", HERMES_TURN[1:])
    assert (tie.reward, tie.label) == (0.0, "tie")


def test_outcome_parse_failures_and_unjudged(server):
    server.add(Reply(["no idea"]), Reply(['{"judgement": "maybe"}']), Reply(["```json\n{}\n```"]))
    evaluator = evaluator_for(server, max_retries=2)
    result = evaluator.evaluate("q", HERMES_TURN[1:])
    assert (result.reward, result.label, dict(result.votes)) == (0.0, None, {})
    stats = evaluator.stats
    assert (stats.requests, stats.parse_failures, stats.unjudged, stats.votes) == (3, 3, 1, 0)


def test_outcome_evaluate_many_keeps_order(server):
    def by_query(body):
        query = last_user_content(body).split("# Query\n")[1].split("\n")[0]
        return [judgement({"good": "true", "bad": "false"}.get(query, "unable_to_answer"))]

    server.handler = by_query
    results = evaluator_for(server).evaluate_many(
        ["good", "bad", "other", "good"], [HERMES_TURN[1:]] * 4, max_workers=4)
    assert [r.reward for r in results] == [1.0, -1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="got 2 queries, 1 trajectories"):
        evaluator_for(server).evaluate_many(["a", "b"], [HERMES_TURN])
