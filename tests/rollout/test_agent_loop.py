"""Tool loops and CM2 dialogues: token accounting, masks, ids, limits, strictness."""

import json

import numpy as np
import pytest

from agentrl import credit
from agentrl.envs.judges import ChecklistItem, RuleJudge, answer_contains, tool_called
from agentrl.envs.tools import truncate_middle
from agentrl.models import get_tokenizer
from agentrl.models.chat import render_messages
from agentrl.rollout.agent_loop import (
    DialogueSpec,
    LoopConfig,
    PromptSpec,
    run_dialogue_loop,
    run_tool_loop,
)
from agentrl.types import collate, to_device
from tests.rollout.scripted import SCRIPTED_LOGPROB, ScriptedEngine

TOKENIZER = get_tokenizer("qwen2.5")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calculator_executor(calls):
    results = []
    for c in calls:
        if c["name"] != "calculator":
            results.append(f"Error: unknown tool {c['name']!r}; available: ['calculator']")
        else:
            results.append(str(eval(c["arguments"]["expression"], {"__builtins__": {}})))
    return results


def two_step_policy(prompt_text):
    """Calls the calculator once, then answers with its result."""
    if "<tool_response>" not in prompt_text:
        return "I will compute it.\n" + call("calculator", expression="37*43")
    result = prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
    return f"The answer is {result}."


def check_token_accounting(trajectory, tools=None, tokenizer=TOKENIZER, flavour="qwen2.5"):
    """Concatenated tokens reproduce the rendered conversation; masks and ids line up."""
    messages = trajectory.metadata["messages"]
    tokens = trajectory.tokens.tolist()
    text = tokenizer.decode(tokens)
    if text.endswith("<|im_start|>assistant\n"):  # stopped before its next generation
        rendered = render_messages(messages, tools=tools, flavour=flavour,
                                   add_generation_prompt=True)
        assert text == rendered
    else:
        rendered = render_messages(messages, tools=tools, flavour=flavour)
        assert text + "\n" == rendered
    assert tokenizer.encode(rendered)[: len(tokens)] == tokens
    policy = trajectory.loss_mask
    # Policy tokens are exactly the assistant turns' bodies and their <|im_end|>.
    rendered_turns = rendered.split("<|im_start|>assistant\n")[1:]
    assistant_text = "".join(turn.split("<|im_end|>", 1)[0] + "<|im_end|>"
                             for turn in rendered_turns if turn)
    assert tokenizer.decode(trajectory.tokens[policy].tolist()) == assistant_text
    assert (trajectory.step_id[~policy] == -1).all() and (trajectory.step_id[policy] >= 0).all()
    steps = trajectory.step_id[policy]
    assert (np.diff(steps) >= 0).all() and steps[0] == 0
    assert set(steps) == set(range(steps.max() + 1))
    np.testing.assert_array_equal(trajectory.rollout_logprobs[~policy], 0.0)


def test_tool_loop_executes_calls_and_accounts_every_token():
    engine = ScriptedEngine(TOKENIZER, two_step_policy)
    prompt = PromptSpec("q0", ({"role": "user", "content": "What is 37*43?"},), (CALCULATOR,),
                        {"golds": ["1591"]})
    trajectories = run_tool_loop(engine, TOKENIZER, [prompt], calculator_executor, group_size=2)
    assert len(trajectories) == 2 and engine.calls == 2  # both members batched per step
    for member, trajectory in enumerate(trajectories):
        assert trajectory.metadata["finish"] == "answer"
        assert trajectory.metadata["member"] == member
        assert trajectory.metadata["golds"] == ["1591"]
        assert trajectory.metadata["messages"][-1]["content"] == "The answer is 1591."
        check_token_accounting(trajectory, tools=[CALCULATOR])
        assert trajectory.num_steps == 2 and trajectory.num_turns == 1
        np.testing.assert_allclose(trajectory.rollout_logprobs[trajectory.loss_mask],
                                   SCRIPTED_LOGPROB)


def test_steps_are_turns_option():
    engine = ScriptedEngine(TOKENIZER, two_step_policy)
    prompt = PromptSpec("q0", ({"role": "user", "content": "37*43?"},), (CALCULATOR,))
    (trajectory,) = run_tool_loop(engine, TOKENIZER, [prompt], calculator_executor,
                                  LoopConfig(steps_are_turns=True))
    np.testing.assert_array_equal(trajectory.turn_id, trajectory.step_id)


def test_limits_end_episodes_with_their_reason():
    prompt = PromptSpec("q", ({"role": "user", "content": "loop"},), (CALCULATOR,))
    always_call = ScriptedEngine(TOKENIZER, lambda text: call("calculator", expression="1+1"))
    (capped,) = run_tool_loop(always_call, TOKENIZER, [prompt], calculator_executor,
                              LoopConfig(max_steps=3))
    assert capped.metadata["finish"] == "max_steps" and capped.num_steps == 3
    rambling = ScriptedEngine(TOKENIZER, lambda text: "word " * 200)
    (cut,) = run_tool_loop(rambling, TOKENIZER, [prompt], calculator_executor,
                           LoopConfig(max_step_tokens=16))
    assert cut.metadata["finish"] == "step_tokens" and cut.loss_mask.sum() == 16
    (full,) = run_tool_loop(always_call, TOKENIZER, [prompt], calculator_executor,
                            LoopConfig(max_steps=50, max_context_tokens=200))
    assert full.metadata["finish"] in ("context", "step_tokens")
    assert len(full.tokens) <= 200


def test_tool_errors_go_back_to_the_policy():
    def policy(text):
        if "<tool_response>" in text:
            return "Sorry."
        return call("weather", city="Oslo")

    engine = ScriptedEngine(TOKENIZER, policy)
    prompt = PromptSpec("q", ({"role": "user", "content": "weather?"},), (CALCULATOR,))
    (trajectory,) = run_tool_loop(engine, TOKENIZER, [prompt], calculator_executor)
    tool_message = trajectory.metadata["messages"][2]
    assert tool_message["role"] == "tool" and "unknown tool 'weather'" in tool_message["content"]
    check_token_accounting(trajectory, tools=[CALCULATOR])


def test_long_tool_outputs_are_truncated_in_the_middle():
    text = "a" * 50 + "b" * 50
    cut = truncate_middle(text, 20)
    assert cut.startswith("a" * 10) and cut.endswith("b" * 10) and "80 characters omitted" in cut
    assert truncate_middle("short", 20) == "short"


# ---------------------------------------------------------------------------
# CM2 dialogues.
# ---------------------------------------------------------------------------


def item(item_id, question, weight, rule, *, dependency=(), strict=False):
    return ChecklistItem(item_id, question, weight=weight, dependency=tuple(dependency),
                         strict=strict, rule=rule)


DIALOGUE = DialogueSpec(
    prompt_id="d0",
    system="You are a booking assistant.",
    user_turns=("Book a table for two at 7pm.", "Also send me a confirmation."),
    checklists=(
        (item("c1", "Did it call book_table?", 0.6, tool_called("book_table"), strict=True),
         item("c2", "Did it confirm the time 7pm?", 0.4, answer_contains("7pm"),
              dependency=("c1",))),
        (item("c3", "Did it call send_confirmation?", 1.0, tool_called("send_confirmation"),
              strict=True),),
    ),
    tools=(CALCULATOR,),
)


def booking_policy(text):
    last_user = text.rsplit("<|im_start|>user\n", 1)[1]
    if "confirmation" in last_user and "<tool_response>" not in last_user:
        return call("send_confirmation", to="me")
    if "confirmation" in last_user:
        return "Confirmation sent."
    if "<tool_response>" not in last_user:
        return call("book_table", people=2, time="7pm")
    return "Booked for two at 7pm."


def echo_executor(spec):
    return lambda calls: [f"ok: {c['name']}" for c in calls]


def test_dialogue_follows_turns_and_fills_the_checklist():
    engine = ScriptedEngine(TOKENIZER, booking_policy)
    (trajectory,) = run_dialogue_loop(engine, TOKENIZER, [DIALOGUE], echo_executor, RuleJudge())
    assert trajectory.metadata["finish"] == "completed"
    check_token_accounting(trajectory, tools=[CALCULATOR])
    assert trajectory.num_turns == 2 and trajectory.num_steps == 4
    sat = trajectory.checklist_sat_after
    # Turn 0: step 0 (book_table call) satisfies c1; step 1 (reply) satisfies c2 too.
    np.testing.assert_array_equal(sat[0, :2, :2], [[True, False], [True, True]])
    np.testing.assert_array_equal(sat[1, :2, :1], [[True], [True]])
    np.testing.assert_array_equal(trajectory.checklist_step_mask, [[True, True], [True, True]])
    np.testing.assert_array_equal(trajectory.checklist_deps[0], [[False, False], [True, False]])
    assert trajectory.reference_turns == 2
    # The step ids of turn 1 continue the global count; turn ids follow the turns.
    policy = trajectory.loss_mask
    np.testing.assert_array_equal(np.unique(trajectory.turn_id[policy]), [0, 1])


def test_strictness_rule_ends_the_dialogue():
    def lazy(text):
        return "Sure, done."  # never calls book_table: strict item c1 fails

    engine = ScriptedEngine(TOKENIZER, lazy)
    (trajectory,) = run_dialogue_loop(engine, TOKENIZER, [DIALOGUE], echo_executor, RuleJudge())
    assert trajectory.metadata["finish"] == "strict_failed"
    assert trajectory.num_turns == 1
    assert not trajectory.checklist_step_mask[1].any()


def test_dialogue_batch_feeds_the_checklist_scheme():
    engine = ScriptedEngine(TOKENIZER, booking_policy)
    lazy_engine_answers = {0: booking_policy, 1: lambda text: "Done."}
    trajectories = run_dialogue_loop(engine, TOKENIZER, [DIALOGUE], echo_executor, RuleJudge(),
                                     group_size=2)
    lazy = run_dialogue_loop(ScriptedEngine(TOKENIZER, lazy_engine_answers[1]), TOKENIZER,
                             [DIALOGUE], echo_executor, RuleJudge())
    batch = to_device(collate([trajectories[0], lazy[0]], group_size=2))
    output = credit.get_scheme("checklist")(batch, level="step")
    advantages = np.asarray(output.advantages)
    assert advantages[0][np.asarray(batch.loss_mask[0])].max() > 0  # the good rollout
    assert (advantages[1][np.asarray(batch.loss_mask[1])] <= 0).all()
    with pytest.raises(ValueError, match="2 user turns but 1 checklists"):
        DialogueSpec("x", ("a", "b"), ((item("c", "q", 1.0, answer_contains("x")),),))
