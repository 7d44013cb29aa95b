"""MT-GRPO two-turn tool-use rewards (SPEC §4; `turn_level_credit_mt_grpo_mt_ppo.txt` App. D.2).

The agent (App. D.1, D.5) writes `<reasoning>…</reasoning>` then a JSON tool
command in `<tool>…</tool>`; the environment answers with the tool output in
`<result>…</result>` (or a message starting with `"Error:"`); the agent then
writes `<reasoning>…</reasoning><answer>…</answer>`.

Turn-level vs outcome (App. D.2): "turn-level rewards evaluate only the
performance of the agent's first turn, whereas outcome-level rewards assess
the quality of the entire trajectory". Turn-level: tool execution (0.2) and
search-result answer presence (0.5), from the first assistant message and the
environment's reply. Outcome: final answer presence (0.5), exact match (1.0),
XML format (≤ 0.2) and XML tag usage (≤ 0.2), from all assistant messages.
They feed `agentrl.credit.mt_grpo_advantages` as `turn_rewards[..., 0]` and
`outcome`.
"""

import re
from collections.abc import Sequence

from agentrl.rewards.answers import answer_in_text, as_golds
from agentrl.rewards.parsing import as_text, count_tag, extract_tag, find_tag_blocks

TOOL_EXECUTION_REWARD = 0.2
SEARCH_ANSWER_REWARD = 0.5
ANSWER_PRESENCE_REWARD = 0.5
EXACT_MATCH_REWARD = 1.0
XML_FORMAT_SCALE = 0.2
XML_TAG_USAGE_SCALE = 0.2

# The schema of App. D.2: `<reasoning>` followed by either `<tool>` or `<answer>`.
_FIELDS = (("reasoning",), ("tool", "answer"))
_SCHEMA_TAGS = ("reasoning", "tool", "answer")
# A schema tag, possibly with whitespace inside its brackets (possessive: linear time).
_SPACED_TAG = re.compile(r"<(\s*+)(/?)(\s*+)(reasoning|tool|answer)(\s*+)>")


def _tool_output(env_response: str | None) -> str:
    """The tool's output: the `<result>` content if there is one, else the stripped reply."""
    text = as_text(env_response, "env_response")
    result = extract_tag(text, "result")
    return text.strip() if result is None else result


def _tool_executed(turn_text: str | None, env_response: str | None) -> bool:
    if not find_tag_blocks(as_text(turn_text, "turn_text"), "tool"):
        return False
    output = _tool_output(env_response)
    return bool(output) and not output.startswith("Error:")


def mt_grpo_tool_execution_reward(turn_text: str | None, env_response: str | None) -> float:
    """Tool execution reward (App. D.2): 0.2 if the tool call was correctly executed.

    `0.2 · 1[turn has a <tool>…</tool> block ∧ env reply does not begin with "Error:"]`.

    Reading: "properly formatted tool call" is a complete `<tool>…</tool>`
    block; whether its JSON names a real tool with valid `args` is decided by
    the environment, which then answers `"Error: …"` (App. D.1). The reply is
    checked on its `<result>` content when it has one (the environment wraps
    tool output, errors included, in `<result>`), else on the whole stripped
    reply; an empty or missing (`None`) reply is not a successful execution.

    Args:
      turn_text: the agent's first-turn message (never raises on it).
      env_response: the environment's reply to it, `None` if it was not invoked.

    Returns:
      0.2 or 0.0.
    """
    return TOOL_EXECUTION_REWARD if _tool_executed(turn_text, env_response) else 0.0


def mt_grpo_search_answer_reward(
    turn_text: str | None, env_response: str | None, golds: str | Sequence[str]
) -> float:
    """Search-result answer presence (App. D.2): 0.5 if an accepted answer is in the results.

    `0.5 · 1[some accepted answer occurs case-insensitively in the <result> text]`.

    Reading: only a successfully executed tool call returns search results, so
    this is 0 whenever `mt_grpo_tool_execution_reward` is 0 (an `"Error: …"`
    reply that echoes the query is not a search result). Matching is
    `answer_in_text` (case-insensitive substring, empty answers skipped).

    Args:
      turn_text: the agent's first-turn message (never raises on it).
      env_response: the environment's reply, `None` if it was not invoked.
      golds: one accepted answer or a list of them.

    Returns:
      0.5 or 0.0.
    """
    golds = as_golds(golds)
    if not _tool_executed(turn_text, env_response):
        return 0.0
    found = answer_in_text(_tool_output(env_response), golds)
    return SEARCH_ANSWER_REWARD if found else 0.0


def _final_answer(assistant_messages: Sequence[str | None]) -> str | None:
    messages = _check_messages(assistant_messages)
    return extract_tag(messages[-1], "answer") if messages else None


def mt_grpo_answer_presence_reward(
    assistant_messages: Sequence[str | None], golds: str | Sequence[str]
) -> float:
    """Final answer presence (App. D.2): 0.5 if an accepted answer is in the final answer.

    `0.5 · 1[some accepted answer occurs case-insensitively in a]`, `a` the
    last `<answer>` content of the last assistant message.

    Reading: the "final response" is the last assistant message; no
    `<answer>` block there scores 0. Matching is `answer_in_text`.

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).
      golds: one accepted answer or a list of them.

    Returns:
      0.5 or 0.0.
    """
    golds = as_golds(golds)
    answer = _final_answer(assistant_messages)
    return ANSWER_PRESENCE_REWARD if answer is not None and answer_in_text(answer, golds) else 0.0


def mt_grpo_exact_match_reward(
    assistant_messages: Sequence[str | None], golds: str | Sequence[str]
) -> float:
    """Exact match (App. D.2): 1.0 if the final answer equals an accepted answer.

    `1.0 · 1[∃g: casefold(strip(a)) == casefold(strip(g))]`, `a` as in
    `mt_grpo_answer_presence_reward`.

    Reading: App. D.2 names its preprocessing, "lowercasing and stripping
    whitespace", so this is that (casefold for Unicode lower case), not the
    SQuAD normalisation of `exact_match`: articles and punctuation count.

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).
      golds: one accepted answer or a list of them.

    Returns:
      1.0 or 0.0.
    """
    golds = as_golds(golds)
    answer = _final_answer(assistant_messages)
    if answer is None:
        return 0.0
    key = answer.strip().casefold()
    return EXACT_MATCH_REWARD if any(key == g.strip().casefold() for g in golds) else 0.0


def mt_grpo_xml_format_score(message: str | None) -> float:
    """Unscaled XML format score of one assistant message (App. D.2), in [0, 1].

    `0.4 · presence + 0.2 · spacing + 0.2 · start + 0.2 · end`, where
    presence = fraction of the schema's two fields (`<reasoning>`; `<tool>` or
    `<answer>`) present as a complete block, spacing = no schema tag written
    with whitespace inside its brackets, start = the stripped message starts
    with `<reasoning>`, end = it ends with `</tool>` or `</answer>`.

    Reading:
      * Presence: App. D.2 says "presence of at least one expected field" with
        "partial credit"; we give 0.4 × the fraction of the two field slots
        present (0 with none, 0.4 with both), as the authors' released
        `verifiers` XMLParser format reward does.
      * Spacing: "no leading or trailing whitespace within tags" is read as
        whitespace inside the tag brackets (`< reasoning>`, `</answer >`,
        `< /tool>`), the error in the paper's malformed example (Table 7).
        Whitespace around a block's content is allowed: the paper's correct
        example (Table 5) writes `<answer> John Wayne Gacy </answer>`.

    Args:
      message: one assistant message (never raises on it).

    Returns:
      The score in [0, 1].
    """
    text = as_text(message, "message")
    present = sum(any(find_tag_blocks(text, t) for t in field) for field in _FIELDS)
    spacing = not any(m.group(1) or m.group(3) or m.group(5) for m in _SPACED_TAG.finditer(text))
    stripped = text.strip()
    start = stripped.startswith("<reasoning>")
    end = stripped.endswith(("</tool>", "</answer>"))
    return 0.4 * present / len(_FIELDS) + 0.2 * spacing + 0.2 * start + 0.2 * end


def mt_grpo_xml_tag_usage_score(message: str | None) -> float:
    """Unscaled XML tag usage score of one assistant message (App. D.2), in [0, 1].

    `#{correctly used tags} / #{tags checked}`; the tags checked are those of
    `<reasoning>`, `<tool>`, `<answer>` whose opening or closing tag occurs in
    the message; one is correctly used iff it has exactly one opening and
    exactly one closing tag. A message using none of them scores 0.

    Reading: "the proportion of correctly used tags (normalized by the number
    of tags checked)" counts whole tags (opening and closing together), so a
    tag with two `<answer>` and one `</answer>` is simply incorrect. Tags not
    used in a message are not checked (a tool-call message has no `<answer>`).

    Args:
      message: one assistant message (never raises on it).

    Returns:
      The score in [0, 1].
    """
    text = as_text(message, "message")
    counts = [count_tag(text, tag) for tag in _SCHEMA_TAGS]
    checked = [c for c in counts if c != (0, 0)]
    if not checked:
        return 0.0
    return sum(c == (1, 1) for c in checked) / len(checked)


def _check_messages(assistant_messages: Sequence[str | None]) -> list[str]:
    if isinstance(assistant_messages, str | bytes) or not isinstance(assistant_messages, Sequence):
        raise ValueError(
            "assistant_messages must be a sequence of message strings, got "
            f"{type(assistant_messages).__name__} {assistant_messages!r:.80}; "
            "wrap a single message in a list: [text]"
        )
    return [as_text(m, "assistant_messages[i]") for m in assistant_messages]


def _mean_scaled(scores: list[float], scale: float) -> float:
    return scale * sum(scores) / len(scores) if scores else 0.0


def mt_grpo_xml_format_reward(assistant_messages: Sequence[str | None]) -> float:
    """XML format reward (App. D.2): `0.2 × mean_m mt_grpo_xml_format_score(m)`.

    Reading: an outcome reward "assesses the quality of the entire
    trajectory", so the per-message score is averaged over all assistant
    messages (as in the authors' released code); no messages scores 0.

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).

    Returns:
      The reward in [0, 0.2].
    """
    messages = _check_messages(assistant_messages)
    return _mean_scaled([mt_grpo_xml_format_score(m) for m in messages], XML_FORMAT_SCALE)


def mt_grpo_xml_tag_usage_reward(assistant_messages: Sequence[str | None]) -> float:
    """XML tag usage reward (App. D.2): `0.2 × mean_m mt_grpo_xml_tag_usage_score(m)`.

    Reading: averaged over all assistant messages, as `mt_grpo_xml_format_reward`.

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).

    Returns:
      The reward in [0, 0.2].
    """
    messages = _check_messages(assistant_messages)
    return _mean_scaled([mt_grpo_xml_tag_usage_score(m) for m in messages], XML_TAG_USAGE_SCALE)


def mt_grpo_turn_components(
    turn_text: str | None, env_response: str | None, golds: str | Sequence[str]
) -> dict[str, float]:
    """Turn-level rewards of the first turn (App. D.2) and their sum.

    Args:
      turn_text: the agent's first-turn message (never raises on it).
      env_response: the environment's reply, `None` if it was not invoked.
      golds: one accepted answer or a list of them.

    Returns:
      `{"tool_execution", "search_answer", "total"}`; total ∈ [0, 0.7].
    """
    tool = mt_grpo_tool_execution_reward(turn_text, env_response)
    search = mt_grpo_search_answer_reward(turn_text, env_response, golds)
    return {"tool_execution": tool, "search_answer": search, "total": tool + search}


def mt_grpo_turn_reward(
    turn_text: str | None, env_response: str | None, golds: str | Sequence[str]
) -> float:
    """MT-GRPO turn-level reward `R^I_1` = tool execution + search-result answer presence.

    `0.2 · 1[tool executed] + 0.5 · 1[accepted answer in <result>]`
    (App. D.2, "Turn-Level Verifiable Rewards"; SPEC §4).

    Args:
      turn_text: the agent's first-turn message (never raises on it).
      env_response: the environment's reply, `None` if it was not invoked.
      golds: one accepted answer or a list of them.

    Returns:
      The reward in [0, 0.7].
    """
    return mt_grpo_turn_components(turn_text, env_response, golds)["total"]


def mt_grpo_outcome_components(
    assistant_messages: Sequence[str | None], golds: str | Sequence[str]
) -> dict[str, float]:
    """Outcome rewards of a trajectory (App. D.2) and their sum.

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).
      golds: one accepted answer or a list of them.

    Returns:
      `{"answer_presence", "exact_match", "xml_format", "xml_tag_usage",
      "total"}`; total ∈ [0, 1.9].
    """
    parts = {
        "answer_presence": mt_grpo_answer_presence_reward(assistant_messages, golds),
        "exact_match": mt_grpo_exact_match_reward(assistant_messages, golds),
        "xml_format": mt_grpo_xml_format_reward(assistant_messages),
        "xml_tag_usage": mt_grpo_xml_tag_usage_reward(assistant_messages),
    }
    return {**parts, "total": sum(parts.values())}


def mt_grpo_outcome_reward(
    assistant_messages: Sequence[str | None], golds: str | Sequence[str]
) -> float:
    """MT-GRPO outcome reward `R^O` = answer presence + EM + XML format + XML tag usage.

    `0.5 · 1[answer present] + 1.0 · EM + 0.2 · mean format + 0.2 · mean tag usage`
    (App. D.2, "Outcome-Based Verifiable Rewards"; SPEC §4).

    Args:
      assistant_messages: the agent's messages in order (never raises on their
        content).
      golds: one accepted answer or a list of them.

    Returns:
      The reward in [0, 1.9].
    """
    return mt_grpo_outcome_components(assistant_messages, golds)["total"]
