"""Built-in tasks: determinism, demonstrations that replay through the real loops and tools."""

import numpy as np
import pytest

from agentrl import credit
from agentrl.envs.judges import RuleJudge
from agentrl.envs.tasks import available_tasks, final_assistant_text, get_task
from agentrl.models import get_tokenizer
from agentrl.models.chat import render_messages
from agentrl.rollout.agent_loop import (
    LoopConfig,
    registry_executor,
    run_dialogue_loop,
    run_tool_loop,
)
from agentrl.types import collate, to_device
from tests.rollout.scripted import ScriptedEngine

TOKENIZER = get_tokenizer("qwen2.5")


def assistant_text(message):
    """The assistant message as the policy would write it (content + Hermes calls)."""
    rendered = render_messages([message])
    return rendered.split("<|im_start|>assistant\n", 1)[1].rsplit("<|im_end|>", 1)[0]


class DemonstrationPolicy:
    """Replays each instance's demonstration, keyed by the prompt's user question."""

    def __init__(self, instances):
        self.turns = {}
        for instance in instances:
            demo = instance.demonstration
            key = next(m["content"] for m in demo if m["role"] == "user")
            self.turns[key] = [assistant_text(m) for m in demo if m["role"] == "assistant"]

    def __call__(self, prompt_text):
        first_user = prompt_text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        done = prompt_text.count("<|im_start|>assistant\n") - 1
        return self.turns[first_user][done]


def test_registry_and_determinism():
    assert set(available_tasks()) >= {"arithmetic", "multihop_search", "multiturn_tools"}
    for name in ["arithmetic", "multihop_search", "multiturn_tools"]:
        task = get_task(name)
        a = task.instances(5, seed=3)
        b = task.instances(5, seed=3)
        assert [i.golds for i in a] == [i.golds for i in b]
        assert [i.prompt.messages for i in a] == [i.prompt.messages for i in b]
        valid = task.instances(5, seed=3, split="validation")
        assert [i.prompt.prompt_id for i in valid] != [i.prompt.prompt_id for i in a]
    with pytest.raises(KeyError, match="unknown task 'chess'"):
        get_task("chess")
    with pytest.raises(ValueError, match="split='dev'"):
        get_task("arithmetic").instances(1, seed=0, split="dev")


@pytest.mark.parametrize("name", ["arithmetic", "multihop_search"])
def test_demonstrations_replay_through_the_tool_loop_and_earn_full_reward(name):
    task = get_task(name)
    instances = task.instances(12, seed=1)
    engine = ScriptedEngine(TOKENIZER, DemonstrationPolicy(instances))
    trajectories = run_tool_loop(engine, TOKENIZER, [i.prompt for i in instances],
                                 registry_executor(task.registry()), LoopConfig(max_steps=6))
    for instance, trajectory in zip(instances, trajectories, strict=True):
        assert trajectory.metadata["finish"] == "answer"
        final = final_assistant_text(trajectory.metadata["messages"])
        assert task.reward(instance, final) == 1.0
        # The real tools reproduce the demonstration's tool outputs exactly.
        rollout_tools = [m["content"] for m in trajectory.metadata["messages"]
                         if m["role"] == "tool"]
        demo_tools = [m["content"] for m in instance.demonstration if m["role"] == "tool"]
        assert rollout_tools == demo_tools
        assert task.reward(instance, "\\boxed{-1} <answer>nothing</answer>") == 0.0


def test_arithmetic_mix_of_easy_and_hard():
    instances = get_task("arithmetic", hard_fraction=0.5).instances(200, seed=0)
    hard = [i for i in instances if i.metadata["hard"]]
    assert 60 < len(hard) < 140
    for instance in hard:
        calls = [c["name"] for m in instance.demonstration for c in m.get("tool_calls", ())]
        assert calls == ["calculator"]
        assert "```python" in instance.metadata["carl_demonstration"]
    easy = [i for i in instances if not i.metadata["hard"]]
    assert all(int(i.golds[0]) < 19 for i in easy)


def test_arithmetic_demo_tool_rate_leaves_questions_and_drops_some_tool_calls():
    full = get_task("arithmetic", hard_fraction=0.5).instances(400, seed=3)
    half = get_task("arithmetic", hard_fraction=0.5, demo_tool_rate=0.5).instances(400, seed=3)
    assert [i.prompt.messages for i in full] == [i.prompt.messages for i in half]
    hard = [i for i in half if i.metadata["hard"]]
    calls = [sum(len(m.get("tool_calls", ())) for m in i.demonstration) for i in hard]
    assert 0.35 < np.mean(calls) < 0.65  # about half of the hard demonstrations use the tool
    for instance, count in zip(hard, calls, strict=True):  # the others answer directly
        answer = instance.demonstration[-1]["content"]
        assert answer == f"\\boxed{{{instance.golds[0]}}}"
        assert len(instance.demonstration) == (5 if count else 3)
    with pytest.raises(ValueError, match="demo_tool_rate"):
        get_task("arithmetic", demo_tool_rate=1.5)


def test_multihop_questions_need_their_hops():
    task = get_task("multihop_search")
    instances = task.instances(30, seed=2)
    assert {i.metadata["hops"] for i in instances} == {1, 2, 3}
    for instance in instances:
        searches = [m for m in instance.demonstration if m.get("tool_calls")]
        assert len(searches) == instance.metadata["hops"]
        # The demonstration's last search result contains the answer.
        tool_results = [m["content"] for m in instance.demonstration if m["role"] == "tool"]
        assert instance.golds[0] in tool_results[-1]


def test_multiturn_demonstrations_satisfy_every_checklist_item():
    task = get_task("multiturn_tools")
    instances = task.instances(4, seed=0)
    engine = ScriptedEngine(TOKENIZER, DemonstrationPolicy(instances))
    registry = task.registry()
    trajectories = run_dialogue_loop(
        engine, TOKENIZER, [i.dialogue for i in instances],
        lambda spec: registry_executor(registry), RuleJudge())
    for instance, trajectory in zip(instances, trajectories, strict=True):
        assert trajectory.metadata["finish"] == "completed"
        assert trajectory.num_turns == 3
        final = final_assistant_text(trajectory.metadata["messages"])
        assert task.reward(instance, final) == 1.0
    batch = to_device(collate(trajectories, group_size=1))
    sat = np.asarray(batch.checklist_sat_after)
    assert sat.any(axis=2).all()  # every item satisfied in every turn
    output = credit.checklist_credit(
        batch.grouped(batch.checklist_sat_after), batch.grouped(batch.checklist_deps),
        batch.grouped(batch.checklist_weights), batch.grouped(batch.checklist_step_mask),
        batch.grouped(batch.checklist_item_mask), batch.grouped(batch.checklist_step_mask.any(-1)))
    np.testing.assert_allclose(np.asarray(output.traj_reward), 1.0, atol=1e-6)
