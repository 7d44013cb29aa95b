"""Judges: CM2 checklist items (LLM or rule) and PORTool's outcome evaluator.

* `ChecklistJudge` (SPEC §5.2, §5.5; `cm2_checklist_rewards.txt` §4.3, App.
  A.1.4): is checklist item c satisfied by the turn's messages after step s?
  The App. A.1.4 prompt, one JSON verdict (`answer: bool`) per item; options:
  majority vote over k samples, all items of a step in one request. Items
  with a rule (`RuleJudge`) are decided by the rule, without an LLM call.
* `RuleJudge`: deterministic checks for verifiable items (`tool_called`,
  `answer_contains`, `answer_equals`, `answer_matches`,
  `tool_output_contains`) in the same interface.
* `OutcomeEvaluator` (SPEC §6.2; `portool_rewarded_tree.txt` §3.1, §3.2): the
  evaluation agent's true / false / unable_to_answer → R_out = +1 / −1 / 0,
  majority over k samples, ties → 0.

An LLM reply that does not parse is retried; a vote still missing after the
retries counts as "not satisfied" (checklist) or is dropped (outcome), and is
counted in the stats (`JudgeStats`, `OutcomeStats`) that go to the metrics.
"""

import collections
import concurrent.futures
import dataclasses
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agentrl.envs.chat_client import ChatClientError, ChatModel, parse_json_reply
from agentrl.envs.simulated import canonical_arguments
from agentrl.envs.tools import normalize_call
from agentrl.rewards.answers import as_golds, exact_match
from agentrl.rewards.parsing import extract_tag, parse_json, parse_tool_calls

__all__ = [
    "CHECKLIST_BATCH_PROMPT",
    "CHECKLIST_JUDGE_PROMPT",
    "OUTCOME_PROMPT",
    "OUTCOME_REWARDS",
    "ChecklistItem",
    "ChecklistJudge",
    "JudgeStats",
    "OutcomeEvaluator",
    "OutcomeStats",
    "OutcomeVerdict",
    "Rule",
    "RuleJudge",
    "answer_contains",
    "answer_equals",
    "answer_matches",
    "final_answer",
    "format_messages",
    "tool_called",
    "tool_calls_in",
    "tool_output_contains",
]

logger = logging.getLogger(__name__)

# `cm2_checklist_rewards.txt` App. A.1.4, verbatim (PDF line wraps undone, the
# `this_turn_checklist[...]` fields and message strings as named placeholders).
CHECKLIST_JUDGE_PROMPT = """\
# Role
You are a precise checklist evaluator. Your sole task is to judge whether the messages between \
user, assistant and tool satisfy the provided criteria.

# Objective
Produce a strict JSON verdict (no extra text) based on the instructions below.

# Criteria
Question: {question}
Focus on: {focus_on}
Pass condition: {pass_condition}
Failure examples: {failure_examples}
Reference snippet:
{reference_snippet}

# Previous Messages
{messages_before}

# Current Messages to Evaluate
{messages_current}

# Special rule of tool call
If there is no tool call in tool_call part but there are some tool calls in content.thinking \
part, it means these tools' format are not correct and all tool calls are not valid.If there is \
error in tool response. The previous tool calls in latest assistant (only the latest one) are not \
valid.

# Evaluation Process (Align each step to a JSON output field)
1. high_level_understanding_of_the_question:
  - Briefly restate what is being evaluated (the intent of the question + what compliance means \
here).
2. analysis_of_if_focus_on:
  - Check whether Focus on part presents in the Current Messages.
3. analysis_of_pass_condition:
  - Determine if the 'Pass condition' is fully satisfied.
4. analysis_of_failure_examples:
  - For EACH failure example pattern: state clearly 'triggered' or 'not triggered' with a brief \
justification.
5. answer:
  - Return true ONLY IF:
    - * Focus on part is present.
    - * The 'Pass condition' is fully met.
    - * No failure example pattern is triggered.
  - Otherwise return false.

# Output Format
Return ONLY a single JSON object with exactly these keys:
{
 "high_level_understanding_of_the_question": str,
 "analysis_of_if_focus_on": str,
 "analysis_of_pass_condition": str,
 "analysis_of_failure_examples": str,
 "answer": bool
}"""

# Our batched variant of App. A.1.4 (the paper asks one item per request): the
# same role, rules and process, every item's criteria, one verdict per item id.
CHECKLIST_BATCH_PROMPT = """\
# Role
You are a precise checklist evaluator. Your sole task is to judge whether the messages between \
user, assistant and tool satisfy the provided criteria.

# Objective
Produce a strict JSON verdict (no extra text) based on the instructions below. Judge every \
criterion independently.

# Criteria
{criteria}

# Previous Messages
{messages_before}

# Current Messages to Evaluate
{messages_current}

# Special rule of tool call
If there is no tool call in tool_call part but there are some tool calls in content.thinking \
part, it means these tools' format are not correct and all tool calls are not valid.If there is \
error in tool response. The previous tool calls in latest assistant (only the latest one) are not \
valid.

# Evaluation Process (for EACH criterion; align each step to a JSON output field)
1. high_level_understanding_of_the_question:
  - Briefly restate what is being evaluated (the intent of the question + what compliance means \
here).
2. analysis_of_if_focus_on:
  - Check whether Focus on part presents in the Current Messages.
3. analysis_of_pass_condition:
  - Determine if the 'Pass condition' is fully satisfied.
4. analysis_of_failure_examples:
  - For EACH failure example pattern: state clearly 'triggered' or 'not triggered' with a brief \
justification.
5. answer:
  - Return true ONLY IF:
    - * Focus on part is present.
    - * The 'Pass condition' is fully met.
    - * No failure example pattern is triggered.
  - Otherwise return false.

# Output Format
Return ONLY a single JSON object whose keys are the criterion ids ({ids}); each value is a JSON \
object with exactly these keys:
{
 "high_level_understanding_of_the_question": str,
 "analysis_of_if_focus_on": str,
 "analysis_of_pass_condition": str,
 "analysis_of_failure_examples": str,
 "answer": bool
}"""

CRITERION_TEMPLATE = """\
## Criterion {id}
Question: {question}
Focus on: {focus_on}
Pass condition: {pass_condition}
Failure examples: {failure_examples}
Reference snippet:
{reference_snippet}"""

# Our prompt for PORTool's evaluation agent: the paper describes it (§3.1,
# "Evaluation Agent") but does not print one.
OUTCOME_PROMPT = """\
You are the evaluation agent of a tool-use system. A tool-use agent answered the user's query by \
calling tools step by step and ended by calling the final-answer tool with its response.

Your task is to judge whether the agent's final response is correct.
1. Work out a high-quality reference answer to the query through your own reasoning, \
prioritising the knowledge in the trajectory (the tool responses).
2. Compare the agent's final response with your reference answer.
3. Return "true" if the final response correctly answers the query, and "false" if it is wrong, \
incomplete or missing.
4. Return "unable_to_answer" only if the agent's reasoning and tool calls were valid but it could \
not reach an answer because of inherent limitations (for example, the tools complied with their \
formatting requirements but did not return the required information). A wrong answer is \
"false", not "unable_to_answer".

# Query
{query}
{reference_block}
# Trajectory
{trajectory}

# Final response
{final_response}

# Output Format
Return ONLY a single JSON object with exactly these keys:
{
 "reference_answer": str,
 "analysis": str,
 "judgement": "true" | "false" | "unable_to_answer"
}"""

OUTCOME_REWARDS = {"true": 1.0, "false": -1.0, "unable_to_answer": 0.0}

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _fill(template: str, **fields: str) -> str:
    """Substitute `{name}` placeholders in one pass (inserted text is never re-scanned)."""
    return _PLACEHOLDER.sub(lambda m: fields.get(m.group(1), m.group(0)), template)


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def format_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages as the judge reads them: one JSON object per line (App. A.1.1's message schema)."""
    if not messages:
        return "(none)"
    return "\n".join(json.dumps(dict(message), ensure_ascii=False, default=str)
                     for message in messages)


def _decode(arguments: Any) -> Any:
    if isinstance(arguments, str):
        value, err = parse_json(arguments)
        return value if err is None else arguments
    return arguments


def tool_calls_in(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """`(name, arguments)` of every assistant tool call, in order.

    Reads OpenAI `tool_calls` fields and Hermes `<tool_call>` blocks in the
    content (outside `<think>`); JSON-text arguments are decoded.
    """
    calls = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            name, arguments = normalize_call(call)
            calls.append((name, _decode(arguments)))
        content = message.get("content")
        if isinstance(content, str) and "<tool_call>" in content:
            parsed, _ = parse_tool_calls(content.rsplit("</think>", 1)[-1])
            calls.extend((call["name"], call["arguments"]) for call in parsed)
    return calls


def final_answer(messages: Sequence[Mapping[str, Any]], final_tool: str = "response_gen") -> str:
    """The agent's final answer in `messages` ("" if none).

    The `response` argument of the last `final_tool` call if there is one;
    otherwise the last assistant message's visible reply: the text after
    `</think>`, the content of its `<answer>` block if it has one, without
    `<tool_call>` blocks.
    """
    for name, arguments in reversed(tool_calls_in(messages)):
        if name == final_tool and isinstance(arguments, Mapping):
            return str(arguments.get("response", ""))
    for message in reversed(messages):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            text = message["content"].rsplit("</think>", 1)[-1]
            answer = extract_tag(text, "answer")
            if answer is not None:
                return answer
            return re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip()
    return ""


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


class Rule(Protocol):
    """A deterministic item check: `rule(current_messages, previous_messages) -> bool`."""

    def __call__(self, current: Sequence[Mapping[str, Any]],
                 previous: Sequence[Mapping[str, Any]]) -> bool: ...


@dataclasses.dataclass(frozen=True)
class tool_called:  # noqa: N801 - used like a function: tool_called("search", {"query": "x"})
    """The turn has an assistant call of tool `name` whose arguments include `args_subset`.

    Values compare as canonical JSON (`2` equals `2.0`; strings exactly).
    """

    name: str
    args_subset: Mapping[str, Any] | None = None

    def __call__(self, current, previous=()) -> bool:
        for name, arguments in tool_calls_in(current):
            if name != self.name:
                continue
            subset = self.args_subset or {}
            if isinstance(arguments, Mapping) and all(
                key in arguments
                and canonical_arguments(arguments[key]) == canonical_arguments(value)
                for key, value in subset.items()
            ):
                return True
        return False


@dataclasses.dataclass(frozen=True)
class answer_contains:  # noqa: N801
    """The final answer (see `final_answer`) contains `text`."""

    text: str
    case_sensitive: bool = False

    def __call__(self, current, previous=()) -> bool:
        answer = final_answer(current)
        if self.case_sensitive:
            return self.text in answer
        return self.text.casefold() in answer.casefold()


@dataclasses.dataclass(frozen=True)
class answer_equals:  # noqa: N801
    """The final answer equals one of `golds` after SQuAD normalisation (`exact_match`)."""

    golds: str | Sequence[str]

    def __post_init__(self):
        object.__setattr__(self, "golds", tuple(as_golds(self.golds)))

    def __call__(self, current, previous=()) -> bool:
        return exact_match(final_answer(current), list(self.golds)) == 1.0


@dataclasses.dataclass(frozen=True)
class answer_matches:  # noqa: N801
    """The regex `pattern` is found in the final answer (case-insensitive by default)."""

    pattern: str
    flags: int = re.IGNORECASE

    def __post_init__(self):
        try:
            re.compile(self.pattern, self.flags)
        except re.error as err:
            raise ValueError(f"answer_matches pattern {self.pattern!r} is not a regex: {err}") \
                from None

    def __call__(self, current, previous=()) -> bool:
        return re.search(self.pattern, final_answer(current), self.flags) is not None


@dataclasses.dataclass(frozen=True)
class tool_output_contains:  # noqa: N801
    """A tool message of the turn contains `text` (case-insensitive by default)."""

    text: str
    case_sensitive: bool = False

    def __call__(self, current, previous=()) -> bool:
        def norm(value: str) -> str:
            return value if self.case_sensitive else value.casefold()
        return any(message.get("role") == "tool"
                   and norm(self.text) in norm(str(message.get("content") or ""))
                   for message in current)


# ---------------------------------------------------------------------------------------------
# Checklist items and stats
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChecklistItem:
    """One CM2 checklist item (SPEC §5.1; `cm2_checklist_rewards.txt` App. A.1.1).

    Attributes:
      id: the item id within its turn (`"C0"`).
      question, focus_on, pass_condition: the paper's fields.
      failure_examples: the paper's list of failure patterns.
      evidence: the paper's evidence pointers (`[{turn, step, from, snippet}]`)
        or a plain text; shown to the judge as the reference snippet.
      weight: `w_{t,c}` (None when the turn's `weight` map holds it).
      dependency: ids of prerequisite items of the same turn.
      strict: `required_for_next_turn`.
      rule: a deterministic `Rule` deciding this item instead of the LLM.
    """

    id: str
    question: str
    focus_on: str = ""
    pass_condition: str = ""
    failure_examples: tuple[str, ...] = ()
    evidence: Any = ()
    weight: float | None = None
    dependency: tuple[str, ...] = ()
    strict: bool = False
    rule: Rule | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], rule: Rule | None = None) -> "ChecklistItem":
        """From the paper's JSON item (`id`, `question`, `focus_on`, `pass_condition`,
        `failure_examples`, `evidence`, `weight`, `dependency`, `required_for_next_turn`)."""
        for field in ("id", "question"):
            if not isinstance(data.get(field), str):
                shown = json.dumps(data, default=str)[:200]
                raise ValueError(f"checklist item field {field!r} must be a str, got "
                                 f"{data.get(field)!r:.80} in {shown}")
        examples = data.get("failure_examples") or ()
        return cls(
            id=data["id"], question=data["question"], focus_on=str(data.get("focus_on", "")),
            pass_condition=str(data.get("pass_condition", "")),
            failure_examples=(examples,) if isinstance(examples, str) else tuple(examples),
            evidence=data.get("evidence") or (), weight=data.get("weight"),
            dependency=tuple(data.get("dependency") or data.get("depends_on") or ()),
            strict=bool(data.get("required_for_next_turn", data.get("strict", False))),
            rule=rule,
        )

    def reference_snippet(self) -> str:
        """The evidence as text: one `- [from] snippet` line per pointer."""
        if isinstance(self.evidence, str):
            return self.evidence or "(none)"
        lines = []
        for pointer in self.evidence or ():
            if isinstance(pointer, Mapping):
                source = pointer.get("from")
                snippet = pointer.get("snippet", "")
                lines.append(f"- [{source}] {snippet}" if source else f"- {snippet}")
            else:
                lines.append(f"- {pointer}")
        return "\n".join(lines) or "(none)"

    def criteria_fields(self) -> dict[str, str]:
        return {"id": self.id, "question": self.question, "focus_on": self.focus_on,
                "pass_condition": self.pass_condition,
                "failure_examples": json.dumps(list(self.failure_examples), ensure_ascii=False),
                "reference_snippet": self.reference_snippet()}


def _as_item(item: ChecklistItem | Mapping[str, Any]) -> ChecklistItem:
    return item if isinstance(item, ChecklistItem) else ChecklistItem.from_dict(item)


@dataclasses.dataclass
class JudgeStats:
    """Checklist-judge counters, for the metrics.

    Attributes:
      requests: LLM requests.
      replies: LLM replies received (a request with n=k gives k).
      parse_failures: verdicts that could not be read (a reply that does not
        parse counts once per item it should have judged).
      votes: verdicts read.
      defaulted_votes: votes still missing after the retries, counted False.
      llm_items: item judgements made by the LLM.
      rule_items: item judgements made by a rule.
      client_errors: requests that failed for good (server down, HTTP error).
    """

    requests: int = 0
    replies: int = 0
    parse_failures: int = 0
    votes: int = 0
    defaulted_votes: int = 0
    llm_items: int = 0
    rule_items: int = 0
    client_errors: int = 0

    def as_dict(self, prefix: str = "judge/") -> dict[str, int]:
        return {prefix + key: value for key, value in dataclasses.asdict(self).items()}


class _Counters:
    """Thread-safe increments on a stats dataclass."""

    def __init__(self, stats):
        self._stats = stats
        self._lock = threading.Lock()

    def add(self, **amounts: int) -> None:
        with self._lock:
            for field, amount in amounts.items():
                setattr(self._stats, field, getattr(self._stats, field) + amount)

    def snapshot(self):
        with self._lock:
            return dataclasses.replace(self._stats)


def _verdict(value: Any) -> bool | None:
    """`answer` of one verdict object (a bool or "true"/"false"), else None."""
    if isinstance(value, Mapping):
        value = value.get("answer")
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def _majority(votes: Sequence[bool], samples: int) -> bool:
    """True iff more than half of the `samples` votes are True (missing votes are False)."""
    return 2 * sum(votes) > samples


# ---------------------------------------------------------------------------------------------
# Judges
# ---------------------------------------------------------------------------------------------


class RuleJudge:
    """Deterministic judge: each item is decided by its `rule`, or by `rules[item.id]`.

    Same call interface as `ChecklistJudge`.
    """

    def __init__(self, rules: Mapping[str, Rule] | None = None):
        self.rules = dict(rules or {})
        self._counters = _Counters(JudgeStats())

    @property
    def stats(self) -> JudgeStats:
        return self._counters.snapshot()

    def rule_for(self, item: ChecklistItem) -> Rule | None:
        return item.rule if item.rule is not None else self.rules.get(item.id)

    def judge(self, items: Sequence[ChecklistItem | Mapping[str, Any]],
              current: Sequence[Mapping[str, Any]],
              previous: Sequence[Mapping[str, Any]] = ()) -> list[bool]:
        """Per-item satisfaction of the turn's messages so far (`current`)."""
        items = [_as_item(item) for item in items]
        verdicts = []
        for item in items:
            rule = self.rule_for(item)
            if rule is None:
                raise ValueError(f"checklist item {item.id!r} has no rule; give it one "
                                 f"(ChecklistItem.rule or RuleJudge(rules={{{item.id!r}: ...}})) "
                                 f"or judge it with ChecklistJudge; rules exist for "
                                 f"{sorted(self.rules)}")
            verdicts.append(bool(rule(current, previous)))
        self._counters.add(rule_items=len(items))
        return verdicts


class ChecklistJudge(RuleJudge):
    """CM2's LLM checklist judge (App. A.1.4), with rule items mixed in.

    Args:
      client: the judge LLM (`ChatClient` or any `ChatModel`).
      samples: k verdicts per item; the item is satisfied iff more than k/2
        say so (a vote missing after the retries counts as "no").
      batch_items: judge all LLM items of a step in one request (our batched
        prompt, `CHECKLIST_BATCH_PROMPT`) instead of one request per item
        with the paper's prompt.
      max_retries: extra requests for verdicts that did not parse.
      temperature: sampling temperature (None: 0 for k = 1, 1.0 for k > 1).
      max_tokens: completion budget per request.
      max_workers: parallel requests (per-item mode).
      rules: rules by item id, for items without their own `rule`.
      raise_on_client_error: raise `ChatClientError` when the server fails
        for good instead of counting the missing votes as "no".
    """

    def __init__(self, client: ChatModel, *, samples: int = 1, batch_items: bool = True,
                 max_retries: int = 2, temperature: float | None = None, max_tokens: int = 2048,
                 max_workers: int = 8, rules: Mapping[str, Rule] | None = None,
                 raise_on_client_error: bool = False,
                 message_formatter: Callable[[Sequence[Mapping[str, Any]]], str] = format_messages):
        super().__init__(rules)
        if samples < 1 or max_retries < 0 or max_workers < 1:
            raise ValueError(f"need samples >= 1, max_retries >= 0, max_workers >= 1; got "
                             f"samples={samples}, max_retries={max_retries}, "
                             f"max_workers={max_workers}")
        self.client = client
        self.samples = samples
        self.batch_items = batch_items
        self.max_retries = max_retries
        self.temperature = temperature if temperature is not None else (
            0.0 if samples == 1 else 1.0)
        self.max_tokens = max_tokens
        self.max_workers = max_workers
        self.raise_on_client_error = raise_on_client_error
        self.message_formatter = message_formatter

    def judge(self, items: Sequence[ChecklistItem | Mapping[str, Any]],
              current: Sequence[Mapping[str, Any]],
              previous: Sequence[Mapping[str, Any]] = ()) -> list[bool]:
        """Per-item satisfaction of the turn's messages so far.

        Args:
          items: the turn's checklist items (`ChecklistItem` or the paper's dicts).
          current: the turn's messages up to and including step s (the
            agent's action and its tool results): "Current Messages".
          previous: the dialogue before this turn: "Previous Messages".

        Returns:
          One bool per item, in order.
        """
        items = [_as_item(item) for item in items]
        verdicts: dict[str, bool] = {}
        llm_items = []
        for item in items:
            rule = self.rule_for(item)
            if rule is None:
                llm_items.append(item)
            else:
                verdicts[item.id] = bool(rule(current, previous))
                self._counters.add(rule_items=1)
        if llm_items:
            context = {"messages_before": self.message_formatter(previous),
                       "messages_current": self.message_formatter(current)}
            votes = (self._batch_votes(llm_items, context) if self.batch_items
                     else self._item_votes(llm_items, context))
            for item in llm_items:
                missing = self.samples - len(votes[item.id])
                self._counters.add(llm_items=1, defaulted_votes=missing)
                verdicts[item.id] = _majority(votes[item.id], self.samples)
        return [verdicts[item.id] for item in items]

    def judge_turn(self, items: Sequence[ChecklistItem | Mapping[str, Any]],
                   steps: Sequence[Sequence[Mapping[str, Any]]],
                   previous: Sequence[Mapping[str, Any]] = (), *,
                   skip_satisfied: bool = True) -> list[list[bool]]:
        """`sat_after[s][c]` for every step of a turn (SPEC §5.2).

        Args:
          items: the turn's checklist items.
          steps: the turn's messages split by step: `steps[s]` is step s's
            assistant message and its tool results (step 0 starts with the
            user message when it belongs to the turn).
          previous: the dialogue before the turn.
          skip_satisfied: do not ask again about an item already satisfied at
            an earlier step; it stays True. SPEC §5.2 makes satisfaction
            monotone (`Sat(x_{s+1}) = Sat(x_s) OR sat_after[s]`), so the
            credit is unchanged and requests are saved.

        Returns:
          `[S][C]` booleans, the `sat_after` input of `checklist_credit`.
        """
        items = [_as_item(item) for item in items]
        satisfied = [False] * len(items)
        rows, current = [], []
        for step in steps:
            current = [*current, *step]
            todo = [c for c in range(len(items)) if not (skip_satisfied and satisfied[c])]
            row = [True] * len(items)
            for c, verdict in zip(todo, self.judge([items[c] for c in todo], current, previous),
                                  strict=True):
                row[c] = verdict
            satisfied = [done or now for done, now in zip(satisfied, row, strict=True)]
            rows.append(row)
        return rows

    def _ask(self, prompt: str, n: int) -> list[str]:
        """n replies to one prompt ([] when the server fails for good)."""
        self._counters.add(requests=1)
        try:
            replies = self.client.chat([{"role": "user", "content": prompt}],
                                       temperature=self.temperature,
                                       max_tokens=self.max_tokens, n=n)
        except ChatClientError as err:
            self._counters.add(client_errors=1)
            if self.raise_on_client_error:
                raise
            logger.warning("checklist judge request failed: %s", err)
            return []
        self._counters.add(replies=len(replies))
        return replies

    def _item_votes(self, items: Sequence[ChecklistItem],
                    context: Mapping[str, str]) -> dict[str, list[bool]]:
        def one(item: ChecklistItem) -> list[bool]:
            prompt = _fill(CHECKLIST_JUDGE_PROMPT, **item.criteria_fields(), **context)
            votes: list[bool] = []
            for _ in range(self.max_retries + 1):
                for reply in self._ask(prompt, self.samples - len(votes)):
                    vote = _verdict(parse_json_reply(reply)[0])
                    if vote is None:
                        self._counters.add(parse_failures=1)
                    else:
                        votes.append(vote)
                if len(votes) >= self.samples:
                    break
            self._counters.add(votes=len(votes))
            return votes

        if len(items) == 1 or self.max_workers == 1:
            return {item.id: one(item) for item in items}
        with concurrent.futures.ThreadPoolExecutor(min(self.max_workers, len(items))) as pool:
            return dict(zip([item.id for item in items], pool.map(one, items), strict=True))

    def _batch_votes(self, items: Sequence[ChecklistItem],
                     context: Mapping[str, str]) -> dict[str, list[bool]]:
        votes: dict[str, list[bool]] = {item.id: [] for item in items}
        for _ in range(self.max_retries + 1):
            pending = [item for item in items if len(votes[item.id]) < self.samples]
            if not pending:
                break
            criteria = "\n\n".join(_fill(CRITERION_TEMPLATE, **item.criteria_fields())
                                   for item in pending)
            prompt = _fill(CHECKLIST_BATCH_PROMPT, criteria=criteria,
                           ids=", ".join(item.id for item in pending), **context)
            need = max(self.samples - len(votes[item.id]) for item in pending)
            for reply in self._ask(prompt, need):
                parsed, _ = parse_json_reply(reply)
                for item in pending:
                    if len(votes[item.id]) >= self.samples:
                        continue
                    vote = _verdict(parsed.get(item.id)) if isinstance(parsed, dict) else None
                    if vote is None:
                        self._counters.add(parse_failures=1)
                    else:
                        votes[item.id].append(vote)
        self._counters.add(votes=sum(len(v) for v in votes.values()))
        return votes


# ---------------------------------------------------------------------------------------------
# PORTool outcome evaluator
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutcomeVerdict:
    """The evaluation agent's decision on one trajectory.

    Attributes:
      reward: R_out ∈ {+1, −1, 0}.
      label: the majority label (`"true"`, `"false"`, `"unable_to_answer"`),
        `"tie"` when the top labels tie, or None when no sample parsed.
      votes: count of each label among the parsed samples.
    """

    reward: float
    label: str | None
    votes: Mapping[str, int]


@dataclasses.dataclass
class OutcomeStats:
    """Outcome-evaluator counters: requests, replies, parse failures, votes,
    ties, trajectories with no parsed vote (`unjudged`), client errors."""

    requests: int = 0
    replies: int = 0
    parse_failures: int = 0
    votes: int = 0
    ties: int = 0
    unjudged: int = 0
    client_errors: int = 0

    def as_dict(self, prefix: str = "outcome/") -> dict[str, int]:
        return {prefix + key: value for key, value in dataclasses.asdict(self).items()}


def _label(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("judgement", value.get("judgment"))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        label = re.sub(r"[\s-]+", "_", value.strip().lower())
        if label in OUTCOME_REWARDS:
            return label
    return None


class OutcomeEvaluator:
    """PORTool's evaluation agent as an LLM judge (SPEC §6.2).

    Args:
      client: the evaluator LLM.
      samples: k judgements per trajectory; majority label, ties → reward 0.
      max_retries: extra requests for judgements that did not parse.
      temperature: None: 0 for k = 1, 1.0 for k > 1.
      max_tokens: completion budget per request.
      final_tool: the final-answer tool whose `response` is the answer.
      raise_on_client_error: raise instead of returning reward 0 when the
        server fails for good.

    Unlike the paper's agent it has no tools: it judges from the trajectory
    and, when given, a reference answer.
    """

    def __init__(self, client: ChatModel, *, samples: int = 1, max_retries: int = 2,
                 temperature: float | None = None, max_tokens: int = 2048,
                 final_tool: str = "response_gen", raise_on_client_error: bool = False,
                 message_formatter: Callable[[Sequence[Mapping[str, Any]]], str] = format_messages):
        if samples < 1 or max_retries < 0:
            raise ValueError(f"need samples >= 1 and max_retries >= 0; got samples={samples}, "
                             f"max_retries={max_retries}")
        self.client = client
        self.samples = samples
        self.max_retries = max_retries
        self.temperature = temperature if temperature is not None else (
            0.0 if samples == 1 else 1.0)
        self.max_tokens = max_tokens
        self.final_tool = final_tool
        self.raise_on_client_error = raise_on_client_error
        self.message_formatter = message_formatter
        self._counters = _Counters(OutcomeStats())

    @property
    def stats(self) -> OutcomeStats:
        return self._counters.snapshot()

    def prompt(self, query: str, trajectory: Sequence[Mapping[str, Any]],
               reference_answer: str | None = None) -> str:
        reference = (f"\n# Reference answer (from the dataset)\n{reference_answer}\n"
                     if reference_answer else "")
        return _fill(OUTCOME_PROMPT, query=query, reference_block=reference,
                     trajectory=self.message_formatter(trajectory),
                     final_response=final_answer(trajectory, self.final_tool) or "(none)")

    def evaluate(self, query: str, trajectory: Sequence[Mapping[str, Any]],
                 reference_answer: str | None = None) -> OutcomeVerdict:
        """Judge one trajectory (its messages after the query); never raises on model output."""
        prompt = [{"role": "user", "content": self.prompt(query, trajectory, reference_answer)}]
        labels: list[str] = []
        for _ in range(self.max_retries + 1):
            self._counters.add(requests=1)
            try:
                replies = self.client.chat(prompt, temperature=self.temperature,
                                           max_tokens=self.max_tokens,
                                           n=self.samples - len(labels))
            except ChatClientError as err:
                self._counters.add(client_errors=1)
                if self.raise_on_client_error:
                    raise
                logger.warning("outcome evaluator request failed: %s", err)
                break
            self._counters.add(replies=len(replies))
            for reply in replies:
                label = _label(parse_json_reply(reply)[0])
                if label is None:
                    self._counters.add(parse_failures=1)
                else:
                    labels.append(label)
            if len(labels) >= self.samples:
                break
        self._counters.add(votes=len(labels))
        return self._decide(labels)

    def evaluate_many(self, queries: Sequence[str],
                      trajectories: Sequence[Sequence[Mapping[str, Any]]],
                      reference_answers: Sequence[str | None] | None = None, *,
                      max_workers: int = 8) -> list[OutcomeVerdict]:
        """`evaluate` over many trajectories in parallel threads, results in order."""
        references = list(reference_answers or [None] * len(queries))
        if not len(queries) == len(trajectories) == len(references):
            raise ValueError(f"got {len(queries)} queries, {len(trajectories)} trajectories and "
                             f"{len(references)} reference answers; pass one of each per "
                             "trajectory")
        jobs = list(zip(queries, trajectories, references, strict=True))
        with concurrent.futures.ThreadPoolExecutor(max(1, min(max_workers, len(jobs)))) as pool:
            return list(pool.map(lambda job: self.evaluate(*job), jobs))

    def _decide(self, labels: Sequence[str]) -> OutcomeVerdict:
        votes = dict(collections.Counter(labels))
        if not labels:
            self._counters.add(unjudged=1)
            return OutcomeVerdict(0.0, None, votes)
        ranked = collections.Counter(labels).most_common()
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            self._counters.add(ties=1)
            return OutcomeVerdict(0.0, "tie", votes)
        return OutcomeVerdict(OUTCOME_REWARDS[ranked[0][0]], ranked[0][0], votes)
