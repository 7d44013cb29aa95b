"""Built-in tasks: procedurally generated instances, tools, rewards, SFT demonstrations.

A task turns a seed into instances. Each instance carries the prompt (its
messages and the tool schemas offered), the gold answers, and a reference
demonstration: the full dialogue a competent agent would have (assistant
turns with tool calls, tool results), used for a short SFT warm start so a
tiny model can then learn the task with RL on CPU in minutes.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agentrl.rollout.agent_loop import DialogueSpec, PromptSpec


@dataclasses.dataclass(frozen=True)
class TaskInstance:
    """One generated problem.

    Attributes:
      prompt: messages and tools for the tool loop (`run_tool_loop`).
      golds: accepted answers.
      demonstration: the reference dialogue (prompt messages, then assistant /
        tool / user turns), for SFT.
      dialogue: the CM2 reference dialogue (multi-turn tasks only).
      metadata: task-specific facts (difficulty, hops, ...).
    """

    prompt: PromptSpec
    golds: tuple[str, ...]
    demonstration: tuple[dict, ...]
    dialogue: DialogueSpec | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task(Protocol):
    """A built-in task."""

    name: str

    def instances(self, count: int, *, seed: int, split: str = "train") -> list[TaskInstance]:
        """`count` instances; the same seed and split give the same instances."""
        ...

    def registry(self):
        """The `ToolRegistry` of the task's tools."""
        ...

    def reward(self, instance: TaskInstance, final_text: str) -> float:
        """The outcome reward of a rollout whose final answer text is `final_text`."""
        ...


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    """Decorator registering a task factory under `name`."""

    def decorate(factory):
        _TASKS[name] = factory
        return factory

    return decorate


def get_task(name: str, **options) -> Task:
    """A built-in task by name (`arithmetic`, `multihop_search`, `multiturn_tools`)."""
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; available: {sorted(_TASKS)}.")
    return _TASKS[name](**options)


def available_tasks() -> list[str]:
    return sorted(_TASKS)


SPLIT_OFFSETS = {"train": 0, "validation": 1_000_003, "test": 2_000_003}


def split_seed(seed: int, split: str) -> int:
    """Disjoint seed streams per split."""
    if split not in SPLIT_OFFSETS:
        raise ValueError(f"split={split!r} is not one of {sorted(SPLIT_OFFSETS)}.")
    return seed + SPLIT_OFFSETS[split]


def final_assistant_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The last assistant message's content (or its final-answer tool argument)."""
    for message in reversed(messages):
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            if call.get("name") == "response_gen":
                return str((call.get("arguments") or {}).get("response", ""))
        return str(message.get("content") or "")
    return ""
