"""`arithmetic`: answer directly when easy, use a tool when hard (CARL's "knowing when to ask").

Easy questions (one-digit `a + b`, `a − b`) a small model can answer from its
weights; hard ones (three-digit × two-digit products) need the calculator
(tool loop) or a Python code block (CARL segments). The answer goes in
`\\boxed{}`; the reward is exact match of the boxed content (SPEC §7 EM).
"""

import dataclasses

import numpy as np

from agentrl.envs.tasks.base import TaskInstance, register_task, split_seed
from agentrl.envs.tools import ToolRegistry, calculator_tool
from agentrl.rewards.answers import exact_match, extract_boxed
from agentrl.rollout.agent_loop import PromptSpec

SYSTEM = ("Answer the question. Put the final answer in \\boxed{}. For hard arithmetic, call "
          "the calculator first.")
CARL_SYSTEM = ("Answer the question. Put the final answer in \\boxed{}. For hard arithmetic, "
               "write a Python code block; after its output, write a <context> block with the "
               "result, then the answer.")


def _question(rng: np.random.Generator, hard: bool) -> tuple[str, str, str]:
    """`(question, expression, answer)`."""
    if hard:
        a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
        return f"What is {a} * {b}?", f"{a}*{b}", str(a * b)
    a, b = int(rng.integers(0, 10)), int(rng.integers(0, 10))
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", f"{a}+{b}", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", f"{a}-{b}", str(a - b)


def tool_demonstration(question: str, expression: str, answer: str, hard: bool) -> tuple:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if hard:
        call = {"name": "calculator", "arguments": {"expression": expression}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": answer},
        ]
    messages.append({"role": "assistant", "content": f"\\boxed{{{answer}}}"})
    return tuple(messages)


def carl_demonstration(expression: str, answer: str, hard: bool) -> str:
    """The assistant text of a CARL episode (segments: invoke, assimilate, commit)."""
    if not hard:
        return f"\\boxed{{{answer}}}"
    return (f"```python\nprint({expression})\n```\n```output\n{answer}\n```\n"
            f"<context>{expression} = {answer}</context>\\boxed{{{answer}}}")


@register_task("arithmetic")
class ArithmeticTask:
    """Easy / hard arithmetic with a calculator tool."""

    name = "arithmetic"

    def __init__(self, hard_fraction: float = 0.5, compact_prompt: bool = False,
                 demo_tool_rate: float = 1.0):
        """Args:
          hard_fraction: share of questions that need the tool.
          compact_prompt: shorten the calculator's description (165 instead of 247
            prompt tokens; for tiny CPU models).
          demo_tool_rate: share of the hard questions whose demonstration calls
            the calculator; the others answer directly (the right number, as a
            demonstrator who knows it would). Below 1, a policy warm-started on
            the demonstrations under-uses the tool, which RL then corrects (the
            CPU demo's setting).
        """
        for name, value in (("hard_fraction", hard_fraction), ("demo_tool_rate", demo_tool_rate)):
            if not 0 <= value <= 1:
                raise ValueError(f"arithmetic task: {name}={value} must be in [0, 1].")
        self.hard_fraction = hard_fraction
        self.compact_prompt = compact_prompt
        self.demo_tool_rate = demo_tool_rate

    def registry(self) -> ToolRegistry:
        tool = calculator_tool()
        if self.compact_prompt:
            tool = dataclasses.replace(tool, description="Evaluate arithmetic.", parameters={
                "type": "object", "properties": {"expression": {"type": "string"}},
                "required": ["expression"]})
        return ToolRegistry([tool])

    def instances(self, count: int, *, seed: int, split: str = "train") -> list[TaskInstance]:
        rng = np.random.default_rng(split_seed(seed, split))
        demo_rng = np.random.default_rng([split_seed(seed, split), 1])  # questions stay the same
        tools = tuple(self.registry().schemas())
        out = []
        for index in range(count):
            hard = bool(rng.random() < self.hard_fraction)
            question, expression, answer = _question(rng, hard)
            uses_tool = hard and bool(demo_rng.random() < self.demo_tool_rate)
            prompt = PromptSpec(
                prompt_id=f"arithmetic-{split}-{seed}-{index}",
                messages=({"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}),
                tools=tools,
                metadata={"golds": [answer], "hard": hard},
            )
            out.append(TaskInstance(
                prompt=prompt, golds=(answer,),
                demonstration=tool_demonstration(question, expression, answer, uses_tool),
                metadata={"hard": hard, "expression": expression,
                          "carl_demonstration": carl_demonstration(expression, answer, hard),
                          "carl_system": CARL_SYSTEM},
            ))
        return out

    def reward(self, instance: TaskInstance, final_text: str) -> float:
        boxed = extract_boxed(final_text or "")
        return exact_match(boxed, list(instance.golds)) if boxed is not None else 0.0


def demonstration_calls(instance: TaskInstance) -> list[str]:
    """Names of the tools the demonstration calls (for tests and statistics)."""
    return [c["name"] for m in instance.demonstration for c in m.get("tool_calls", ())]
