"""`multiturn_tools`: multi-turn shop dialogues with checklists judged by rules (CM2).

A user asks about an item's price, then adds some to the cart, then checks
out. Tools are deterministic: `get_price(item)`, `add_to_cart(item, quantity)`,
`checkout(items)`. Every turn has an auto-generated checklist (SPEC §5.1):
the right tool called with the right arguments (strict: required for the next
turn) and the reply stating the result (depends on the call). Items are
decided by rules (`agentrl.envs.judges.RuleJudge`), so no LLM judge is needed.
Each instance carries the reference dialogue (`DialogueSpec`) for
`run_dialogue_loop` and the full reference trajectory for SFT.
"""

import numpy as np

from agentrl.envs.judges import ChecklistItem, answer_contains, tool_called
from agentrl.envs.tasks.base import TaskInstance, register_task, split_seed
from agentrl.envs.tools import Tool, ToolError, ToolRegistry
from agentrl.rollout.agent_loop import DialogueSpec, PromptSpec

PRICES = {"apple": 2, "pear": 3, "lemon": 1, "melon": 7, "plum": 4, "fig": 5}
SYSTEM = "You are a shop assistant. Use the tools to answer and act; reply briefly."


def _price(item: str) -> int:
    if item not in PRICES:
        raise ToolError(f"unknown item {item!r}; items: {sorted(PRICES)}")
    return PRICES[item]


def _get_price(item: str) -> str:
    return f"{item}: {_price(item)} coins"


def _add_to_cart(item: str, quantity: int) -> str:
    _price(item)
    if quantity < 1:
        raise ToolError(f"quantity={quantity} must be >= 1")
    return f"added {quantity} {item}"


def _checkout(items: list) -> str:
    total = 0
    for entry in items:
        total += _price(entry["item"]) * int(entry["quantity"])
    return f"total: {total} coins"


def shop_registry() -> ToolRegistry:
    item_schema = {"type": "string", "enum": sorted(PRICES)}
    return ToolRegistry([
        Tool("get_price", "Price of an item in coins.",
             {"type": "object", "properties": {"item": item_schema}, "required": ["item"],
              "additionalProperties": False}, _get_price),
        Tool("add_to_cart", "Add items to the cart.",
             {"type": "object",
              "properties": {"item": item_schema, "quantity": {"type": "integer", "minimum": 1}},
              "required": ["item", "quantity"], "additionalProperties": False}, _add_to_cart),
        Tool("checkout", "Check out a list of items; returns the total.",
             {"type": "object",
              "properties": {"items": {"type": "array", "items": {
                  "type": "object",
                  "properties": {"item": item_schema, "quantity": {"type": "integer"}},
                  "required": ["item", "quantity"]}}},
              "required": ["items"], "additionalProperties": False}, _checkout),
    ])


def _turn(call_name, arguments, result_text, reply, answer_fact):
    """One turn's reference messages and checklist."""
    items = (
        ChecklistItem("C0", f"Did the assistant call {call_name} with {arguments}?",
                      focus_on="tool call", pass_condition=f"{call_name} called with {arguments}",
                      weight=0.6, strict=True, rule=tool_called(call_name, arguments)),
        ChecklistItem("C1", f"Does the reply state '{answer_fact}'?", focus_on="final reply",
                      pass_condition=f"the reply contains {answer_fact!r}", weight=0.4,
                      dependency=("C0",), rule=answer_contains(answer_fact)),
    )
    call = {"name": call_name, "arguments": arguments}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": call_name, "content": result_text},
                {"role": "assistant", "content": reply}]
    return items, messages


@register_task("multiturn_tools")
class MultiturnToolsTask:
    """Three-turn shop dialogues (CM2 checklist rewards)."""

    name = "multiturn_tools"

    def registry(self) -> ToolRegistry:
        return shop_registry()

    def instances(self, count: int, *, seed: int, split: str = "train") -> list[TaskInstance]:
        rng = np.random.default_rng(split_seed(seed, split))
        tools = tuple(self.registry().schemas())
        names = sorted(PRICES)
        out = []
        for index in range(count):
            item = names[int(rng.integers(0, len(names)))]
            quantity = int(rng.integers(1, 6))
            price = PRICES[item]
            total = price * quantity
            user_turns = (f"How much is a {item}?", f"Add {quantity} {item} to my cart.",
                          "Please check out.")
            turns = [
                _turn("get_price", {"item": item}, _get_price(item),
                      f"A {item} costs {price} coins.", f"{price} coins"),
                _turn("add_to_cart", {"item": item, "quantity": quantity},
                      _add_to_cart(item, quantity), f"Added {quantity} {item}.", f"{quantity}"),
                _turn("checkout", {"items": [{"item": item, "quantity": quantity}]},
                      _checkout([{"item": item, "quantity": quantity}]),
                      f"Your total is {total} coins.", f"{total} coins"),
            ]
            prompt_id = f"multiturn-{split}-{seed}-{index}"
            dialogue = DialogueSpec(prompt_id, user_turns, tuple(items for items, _ in turns),
                                    system=SYSTEM, tools=tools,
                                    metadata={"golds": [f"{total} coins"]})
            demonstration = [{"role": "system", "content": SYSTEM}]
            for user, (_, messages) in zip(user_turns, turns, strict=True):
                demonstration += [{"role": "user", "content": user}, *messages]
            prompt = PromptSpec(prompt_id, tuple(demonstration[:2]), tools,
                                {"golds": [f"{total} coins"]})
            out.append(TaskInstance(prompt, (f"{total} coins",), tuple(demonstration),
                                    dialogue=dialogue,
                                    metadata={"item": item, "quantity": quantity}))
        return out

    def reward(self, instance: TaskInstance, final_text: str) -> float:
        """Outcome check of the last reply (the checklist reward is the CM2 signal)."""
        return float(instance.golds[0] in (final_text or ""))
