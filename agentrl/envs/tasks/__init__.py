"""Built-in tasks (procedurally generated from a seed, with SFT demonstrations).

`get_task("arithmetic")`, `get_task("multihop_search")`, `get_task("multiturn_tools")`.
"""

from agentrl.envs.tasks import arithmetic, multihop_search, multiturn_tools  # noqa: F401
from agentrl.envs.tasks.base import (
    Task,
    TaskInstance,
    available_tasks,
    final_assistant_text,
    get_task,
    register_task,
)

__all__ = [
    "Task",
    "TaskInstance",
    "available_tasks",
    "final_assistant_text",
    "get_task",
    "register_task",
]
