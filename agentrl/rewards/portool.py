"""PORTool step format score (SPEC §6.4; `portool_rewarded_tree.txt` §3.2, "Formatting reward")."""

from collections.abc import Sequence

from agentrl.rewards.parsing import as_text, find_tag_blocks, parse_tool_call_blocks

THINK_SCORE = 0.2
TAGS_SCORE = 0.1
JSON_SCORE = 0.1
FIELDS_SCORE = 0.05
SUCCESS_SCORE = 0.55


def portool_format_score_from_flags(
    has_think: bool,
    has_tags: bool,
    json_ok: bool,
    fields_ok: bool,
    n_calls: int,
    n_success: int,
) -> float:
    """Gated PORTool format score from its criteria (SPEC §6.4).

    `0.2·[think] + 0.1·[think ∧ tags] + 0.1·[think ∧ tags ∧ json]
    + 0.05·[think ∧ tags ∧ json ∧ fields]
    + 0.55·[think ∧ tags ∧ json ∧ fields] · n_success / n_calls`.
    Each criterion counts only if all the earlier ones passed; maximum 1.0
    (`portool_rewarded_tree.txt` §3.2, "Formatting reward R_f").

    Args:
      has_think: the step holds a `<think>…</think>` block.
      has_tags: the step holds a `<tool_call>…</tool_call>` block.
      json_ok: every tool-call block's content parses as JSON (a call or a list
        of calls).
      fields_ok: every call has a string `name` and a dict `arguments`.
      n_calls: number of parsed calls (the success fraction's denominator; the
        last term is 0 when `n_calls == 0`).
      n_success: number of those calls that executed successfully.

    Returns:
      The score in [0, 1].

    Raises:
      ValueError: `n_calls < 0`, or `n_success` outside `[0, n_calls]`.
    """
    if n_calls < 0 or not 0 <= n_success <= n_calls:
        raise ValueError(
            f"need 0 <= n_success <= n_calls, got n_success={n_success!r}, n_calls={n_calls!r}; "
            "count successes among the parsed calls only"
        )
    score = 0.0
    for passed, points in ((has_think, THINK_SCORE), (has_tags, TAGS_SCORE),
                           (json_ok, JSON_SCORE), (fields_ok, FIELDS_SCORE)):
        if not passed:
            return score
        score += points
    if n_calls > 0:
        score += SUCCESS_SCORE * n_success / n_calls
    return score


def portool_format_score(step_text: str | None, call_success: Sequence[bool] | None) -> float:
    """PORTool format score of one tool-call step's text (SPEC §6.4).

    `+0.2` if a `<think>…</think>` block is present; only then `+0.1` if a
    `<tool_call>…</tool_call>` block is present; only then `+0.1` if its
    content parses as JSON; only then `+0.05` if every call has a string
    `name` and a dict `arguments`; only then `+0.55 × successes / calls`
    (`portool_rewarded_tree.txt` §3.2 and its system prompt, App. D).

    Reading:
      * Presence is of complete blocks (see `agentrl.rewards.parsing` for the
        pairing rule); the rubric does not ask `<think>` to come first, so
        order is not checked.
      * JSON: each block's content must parse as a JSON object (one call) or
        a JSON array (a list of calls, as App. D's prompt asks). With several
        `<tool_call>` blocks, every block must parse and their calls are
        concatenated in order; a scalar JSON value fails.
      * Fields: every call (array element) must be a JSON object with a `str`
        `name` and a dict `arguments`; an empty array has no call, so it stops
        at +0.4.
      * `call_success` holds one flag per parsed call, in order. Missing flags
        (shorter list, or `None`) count as failed calls, extra flags are
        ignored; it never raises on a length mismatch.
      * Stray or unclosed `<tool_call>` tags next to complete blocks do not
        change the score (the rubric scores the enclosed content).

    Args:
      step_text: the policy's text for this step (never raises on it).
      call_success: one execution flag per parsed call, e.g. the tool
        environment's "did not return an error" bits.

    Returns:
      The score in [0, 1].
    """
    text = as_text(step_text, "step_text")
    parsed = parse_tool_call_blocks(text)
    n_calls = len(parsed.items)
    flags = ([] if call_success is None else list(call_success))[:n_calls]
    return portool_format_score_from_flags(
        has_think=bool(find_tag_blocks(text, "think")),
        has_tags=parsed.n_blocks > 0,
        json_ok=parsed.json_ok,
        fields_ok=parsed.fields_ok,
        n_calls=n_calls,
        n_success=sum(bool(f) for f in flags),
    )
