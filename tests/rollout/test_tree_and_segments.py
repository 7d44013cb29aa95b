"""PORTool tree rollouts and CARL segment rollouts: structure, sharing, views, credit."""

import json
import re

import numpy as np
import pytest

from agentrl import credit
from agentrl.models import get_tokenizer
from agentrl.models.chat import encode_messages
from agentrl.rollout.agent_loop import LoopConfig, PromptSpec
from agentrl.rollout.segments import SegmentConfig, run_segment_rollout
from agentrl.rollout.tree import run_tree_rollout
from agentrl.types import collate, to_device
from tests.rollout.scripted import ScriptedEngine
from tests.rollout.test_agent_loop import check_token_accounting

TOKENIZER = get_tokenizer("qwen3")
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


def tool_call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class BranchingPolicy:
    """Depth-dependent choices drawn from a seeded stream: some branches answer early."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def __call__(self, text):
        depth = text.count("<tool_response>")
        if depth >= 1 and self.rng.random() < 0.4:
            return "<think>\nenough\n</think>\n\n" + tool_call("response_gen", response="Paris")
        return f"<think>\nlook {depth}\n</think>\n\n" + tool_call("search", query=f"q{depth}")


def executor(calls):
    return [f"result for {c['arguments']}" for c in calls]


def test_tree_rollout_yields_n_trajectories_with_shared_prefix_nodes():
    prompts = [PromptSpec(f"q{i}", ({"role": "user", "content": f"Question {i}?"},), (SEARCH,))
               for i in range(2)]
    engine = ScriptedEngine(TOKENIZER, BranchingPolicy(1))
    config = LoopConfig(max_steps=4, final_answer_tool="response_gen")
    trajectories = run_tree_rollout(engine, TOKENIZER, prompts, executor, config, n=4, forks=2)
    assert [t.prompt_id for t in trajectories] == ["q0"] * 4 + ["q1"] * 4
    for query in range(2):
        group = trajectories[4 * query: 4 * query + 4]
        nodes = [t.node_id.tolist() for t in group]
        # Every node lives at one depth; ids are unique within the query.
        depth_of = {}
        for path in nodes:
            for depth, node in enumerate(path):
                assert depth_of.setdefault(node, depth) == depth
        # A node id always has the same parent (a tree), and its copies share the prefix.
        parent_of = {}
        for path in nodes:
            for depth, node in enumerate(path):
                parent = path[depth - 1] if depth else None
                assert parent_of.setdefault(node, parent) == parent
        for t in group:
            assert len(t.node_id) == t.num_steps == len(t.fmt_score)
            assert t.metadata["finish"] in ("final_tool", "max_depth")
            check_token_accounting(t, tools=[SEARCH], tokenizer=TOKENIZER, flavour="qwen3")
            assert ((t.fmt_score >= 0) & (t.fmt_score <= 1)).all()
            # think + tags + JSON + fields + all calls succeeded.
            np.testing.assert_allclose(t.fmt_score, 1.0)
    # Copies share their prefix: some pair of trajectories of a query shares a node.
    assert any(set(t.node_id.tolist()) & set(u.node_id.tolist())
               for i, t in enumerate(trajectories) for u in trajectories[i + 1: (i // 4 + 1) * 4])
    # Tokens of a shared node are identical in every trajectory through it.
    group = trajectories[:4]
    for t in group:
        for u in group:
            common = [d for d in range(min(len(t.node_id), len(u.node_id)))
                      if t.node_id[d] == u.node_id[d]]
            for d in common:
                np.testing.assert_array_equal(t.tokens[t.step_id == d], u.tokens[u.step_id == d])


def test_tree_batch_feeds_the_tree_scheme():
    prompts = [PromptSpec("q", ({"role": "user", "content": "Where?"},), (SEARCH,))]
    engine = ScriptedEngine(TOKENIZER, BranchingPolicy(3))
    trajectories = run_tree_rollout(engine, TOKENIZER, prompts, executor,
                                    LoopConfig(max_steps=3, final_answer_tool="response_gen"),
                                    n=4, forks=4)
    for t, outcome in zip(trajectories, [1.0, -1.0, 0.0, 1.0], strict=True):
        t.outcome = outcome
    batch = to_device(collate(trajectories, group_size=4))
    output = credit.get_scheme("tree")(batch)
    advantages = np.asarray(output.advantages)
    assert np.isfinite(advantages).all()
    assert np.abs(advantages[np.asarray(batch.loss_mask)]).sum() > 0


# ---------------------------------------------------------------------------
# CARL segments.
# ---------------------------------------------------------------------------


def carl_policy(text):
    """One tool call: invoke (code block), assimilate (<context>), commit (boxed)."""
    tail = text.rsplit("<|im_start|>assistant\n", 1)[1]
    if "```python" not in tail:
        return "I need to compute this.\n```python\nprint(37 * 43)\n```\nignored trailing text"
    if "<context>" not in tail:
        return "<context>37*43 = 1591</context> trailing text is cut"
    return "So the answer is \\boxed{1591}."


def run_code(code):
    match = re.fullmatch(r"print\((\d+) \* (\d+)\)\n?", code)
    return str(int(match.group(1)) * int(match.group(2))) if match else "error"


def test_segment_rollout_builds_views_with_replaced_output():
    prompt = encode_messages(TOKENIZER, [{"role": "user", "content": "37*43?"}],
                             add_generation_prompt=True)
    engine = ScriptedEngine(TOKENIZER, carl_policy)
    (episode,) = run_segment_rollout(engine, TOKENIZER, [("q", prompt)], run_code)
    assert len(episode) == 2  # view 0: invoke + raw output + assimilate; view 1: commit
    first, second = episode
    meta = second.metadata
    assert meta["segment_kinds"] == ["invoke", "assimilate", "commit"]
    assert meta["finish"] == "commit" and meta["answer"] == "1591" and meta["tool_calls"] == 1
    first_text = TOKENIZER.decode(first.tokens.tolist())
    assert first_text.endswith("<context>37*43 = 1591</context>")  # cut at the marker
    assert "```output\n1591\n```" in first_text  # the raw output (transient state)
    second_text = TOKENIZER.decode(second.tokens.tolist())
    assert "```output" not in second_text  # replaced by the context block
    assert second_text.startswith(TOKENIZER.decode(prompt))
    assert "print(37 * 43)\n```" in second_text and "ignored trailing" not in second_text
    # Every generated token is trained exactly once, with its segment index.
    np.testing.assert_array_equal(np.unique(first.step_id[first.loss_mask]), [0, 1])
    np.testing.assert_array_equal(np.unique(second.step_id[second.loss_mask]), [2])
    assert first.episode_steps == second.episode_steps == 3 == first.num_steps
    # Boundaries: the state before each segment, transient one included.
    boundaries = meta["boundaries"]
    assert boundaries[0] == (0, len(prompt))
    view, position = boundaries[1]
    assert view == 0 and TOKENIZER.decode(first.tokens[:position].tolist()).endswith("```\n")
    assert boundaries[2][0] == 1
    assert second.tokens[boundaries[2][1]] == second.tokens[second.loss_mask][0]


def test_segment_rows_feed_the_segment_scheme():
    prompt = encode_messages(TOKENIZER, [{"role": "user", "content": "37*43?"}],
                             add_generation_prompt=True)
    engine = ScriptedEngine(TOKENIZER, carl_policy)
    (episode,) = run_segment_rollout(engine, TOKENIZER, [("q", prompt)], run_code)
    values = np.array([0.2, 0.6, 0.9], np.float32)
    for row in episode:
        row.outcome = 1.0
        row.boundary_values = values
    batch = to_device(collate(episode, group_size=1))
    output = credit.get_scheme("segment")(batch)
    advantages = np.asarray(output.advantages)
    # λ = 0: A_k = V_{k+1} − V_k, A_final = R − V_last; each view holds its segments only.
    expected = {0: 0.4, 1: 0.3, 2: 0.1}
    for row in range(2):
        mask = np.asarray(batch.loss_mask[row])
        for token in np.flatnonzero(mask):
            segment = int(batch.step_id[row, token])
            assert advantages[row, token] == pytest.approx(expected[segment], abs=1e-6)


def test_segment_limits():
    prompt = encode_messages(TOKENIZER, [{"role": "user", "content": "x"}],
                             add_generation_prompt=True)
    always_invoke = ScriptedEngine(TOKENIZER, lambda text: (
        "<context>c</context>" if text.endswith("```\n") else "```python\nprint(1 * 1)\n```"))
    (episode,) = run_segment_rollout(always_invoke, TOKENIZER, [("q", prompt)], run_code,
                                     SegmentConfig(max_segments=5))
    assert episode[-1].metadata["finish"] == "max_segments"
    assert episode[-1].metadata["segment_kinds"] == ["invoke", "assimilate"] * 2 + ["invoke"]
