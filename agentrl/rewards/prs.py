"""Progressive Reward Shaping (SPEC §7; `prs_vspo.txt`, "Progressive Reward Shaping").

Two halves:

* The gated sums (eq. 13–15): `prs_short`, `prs_long`, `prs_general`. They take
  Python floats or numpy arrays (elementwise) and return a `float` when every
  input is a scalar, a numpy array otherwise.
* The text-side stage rewards (eq. 8–9): `prs_process_reward`,
  `prs_format_reward`, and `prs_short_components`, which chains them with the
  short-form BLEU answer reward (eq. 10–12) into `PRS_short`.

Trajectory format (the paper's QA-agent prompt, `prs_vspo.txt` App. "Prompt
Template for QA Agent", and eq. 1–2): the trajectory is the list of the
policy's step texts `τ_1 … τ_n, τ_final`. A tool-call step `τ_k = (r_k, tc_k)`
is `<reasoning>…</reasoning>` followed by its tool call(s); the final step
`τ_final = (r_final, a)` is `<reasoning>…</reasoning><answer>…</answer>`.
Reading: the prompt names the `wiki_search` tool but not its call syntax; we
read the tool call as the Hermes / Qwen `<tool_call>{"name": …, "arguments":
{…}}</tool_call>` block (the format Qwen models emit natively), parsed by
`agentrl.rewards.parsing.parse_tool_call_blocks`. The tag names are keyword
arguments.
"""

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentrl.rewards.bleu import short_form_bleu
from agentrl.rewards.parsing import (
    as_text,
    count_tag,
    extract_tag,
    find_tag_blocks,
    parse_tool_call_blocks,
)

FORMAT_REWARD = 0.1
_OPENING_TAG = re.compile(r"\s*<([A-Za-z][\w-]*)>")


def _out(value: np.ndarray, *inputs: Any) -> float | np.ndarray:
    """`float` when every input is a scalar, else the array."""
    if all(np.ndim(x) == 0 for x in inputs):
        return float(value)
    return value


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-log(1 + e^{-x})): no overflow for large |x|.
    return np.exp(-np.logaddexp(0.0, -x))


def prs_short(process: Any, fmt: Any, answer: Any) -> float | np.ndarray:
    """PRS for short-form QA (SPEC §7; `prs_vspo.txt` eq. 13).

    `PRS_short = R_process + R_format` if `R_process < 1`, else
    `R_process + R_format + R_a`.

    Args:
      process: `R_process` ∈ {−1, 0, 1} (eq. 8), float or array.
      fmt: `R_format` ∈ {0, 0.1} (eq. 9), float or array.
      answer: `R_a`, the short-form BLEU of the answer (eq. 10–12), float or array.

    Returns:
      `PRS_short`, elementwise over broadcast inputs; `float` for scalar inputs.
    """
    process, fmt, answer_ = (np.asarray(x, float) for x in (process, fmt, answer))
    base = process + fmt
    return _out(np.where(process < 1, base, base + answer_), process, fmt, answer)


def prs_long(process: Any, fmt: Any, judge: Any, answer: Any) -> float | np.ndarray:
    """PRS for long-form QA (SPEC §7; `prs_vspo.txt` eq. 14).

    `R_process + R_format` while `R_process < 1`; `+ R_judge` once
    `R_process ≥ 1`; `+ R_a` as well once also `R_judge ≥ 1`.

    Args:
      process: `R_process` ∈ {−1, 0, 1}, float or array.
      fmt: `R_format` ∈ {0, 0.1}, float or array.
      judge: `R_judge`, the LLM-as-a-judge score, float or array.
      answer: `R_a`, the answer reward, float or array.

    Returns:
      `PRS_long`, elementwise over broadcast inputs; `float` for scalar inputs.
    """
    p, f, j, a = (np.asarray(x, float) for x in (process, fmt, judge, answer))
    base = p + f
    passed = base + j + np.where(j >= 1, a, 0.0)
    return _out(np.where(p >= 1, passed, base), process, fmt, judge, answer)


def prs_general(stages: Sequence[Any], thresholds: Sequence[Any]) -> float | np.ndarray:
    """General PRS (SPEC §7; `prs_vspo.txt` eq. 15).

    `R_PRS = R_1 + Σ_{i=2}^{m} 1[R_1 ≥ ε_1, …, R_{i−1} ≥ ε_{i−1}] · σ(R_i)`, σ
    the logistic sigmoid. Because σ ∈ (0, 1), passing one more gate always
    adds a positive amount.

    Reading: thresholds are compared with the raw stage rewards `R_i`, not
    with `σ(R_i)` (SPEC §7); a gate that fails closes every later gate.

    Args:
      stages: `[R_1, …, R_m]`, m ≥ 1, each a float or an array (all broadcast
        together).
      thresholds: `[ε_1, …, ε_{m−1}]`, one per gate, floats or arrays.

    Returns:
      `R_PRS`, elementwise; `float` when every stage and threshold is a scalar.

    Raises:
      ValueError: `stages` is empty, or `len(thresholds) != len(stages) − 1`.
    """
    stages, thresholds = list(stages), list(thresholds)
    if not stages:
        raise ValueError("stages is empty ([]); pass at least R_1, e.g. stages=[r1, r2]")
    if len(thresholds) != len(stages) - 1:
        raise ValueError(
            f"thresholds has {len(thresholds)} entries ({thresholds!r:.80}) for {len(stages)} "
            f"stages; pass len(stages) - 1 = {len(stages) - 1} thresholds, ε_i gating R_(i+1)"
        )
    values = [np.asarray(s, float) for s in stages]
    total = values[0]
    gate = np.asarray(True)
    for value, previous, eps in zip(values[1:], values[:-1], thresholds, strict=True):
        gate = gate & (previous >= np.asarray(eps, float))
        total = total + np.where(gate, _sigmoid(value), 0.0)
    return _out(total, *stages, *thresholds)


def _check_steps(step_texts: Sequence[str | None]) -> list[str]:
    if isinstance(step_texts, str | bytes) or not isinstance(step_texts, Sequence):
        raise ValueError(
            f"step_texts must be a sequence of step strings, got {type(step_texts).__name__} "
            f"{step_texts!r:.80}; wrap a single step in a list: [text]"
        )
    return [as_text(t, "step_texts[i]") for t in step_texts]


def prs_process_from_flags(tool_calls_ok: bool, answer_ok: bool) -> float:
    """`R_process` from its two conditions (`prs_vspo.txt` eq. 8).

    `1` if every tool call and the final answer parse; `0` if every tool call
    parses but the answer does not; `−1` otherwise.

    Args:
      tool_calls_ok: every tool call of the trajectory parsed (and executed).
      answer_ok: the final answer parsed.

    Returns:
      −1.0, 0.0 or 1.0.
    """
    if not tool_calls_ok:
        return -1.0
    return 1.0 if answer_ok else 0.0


def prs_process_reward(
    step_texts: Sequence[str | None],
    *,
    call_success: Sequence[bool] | None = None,
    answer_tag: str = "answer",
    tool_tag: str = "tool_call",
) -> float:
    """`R_process` of a trajectory's step texts (SPEC §7; `prs_vspo.txt` eq. 8).

    `R_process = 1` if every tool call `tc_k` and the final answer `a` parse;
    `0` if every `tc_k` parses but `a` does not; `−1` otherwise.

    Reading: the last step is `τ_final`, the earlier ones are tool-call steps
    `τ_k`. "Every `tc_k` parses" means: every earlier step holds at least one
    tool call, every `<tool_call>` block in every step (the final one included)
    parses as JSON into well-formed `{"name": str, "arguments": dict}` calls,
    and no tool-call tag is left unclosed or stray. When `call_success` is
    given, the paper's "… and executed to return observations" is also
    required: one flag per parsed call, in order over the whole trajectory;
    missing flags count as failures. "`a` parses" means the final step holds a
    complete `<answer>…</answer>` block (its content may be anything; its
    quality is `R_a`'s business). An empty trajectory scores −1.

    Args:
      step_texts: the policy's step texts in order (`τ_1 … τ_n, τ_final`).
        Never raises on their content.
      call_success: optional execution flags, one per parsed tool call.
      answer_tag: the final-answer tag.
      tool_tag: the tool-call block tag.

    Returns:
      −1.0, 0.0 or 1.0.

    Raises:
      ValueError: `step_texts` is a bare string or not a sequence.
    """
    steps = _check_steps(step_texts)
    if not steps:
        return -1.0
    parses = [parse_tool_call_blocks(step, tool_tag) for step in steps]
    tools_ok = all(not p.errors and (p.n_blocks == 0 or p.fields_ok) for p in parses)
    tools_ok = tools_ok and all(p.calls for p in parses[:-1])
    if call_success is not None:
        n_calls = sum(len(p.calls) for p in parses)
        flags = list(call_success)[:n_calls]
        tools_ok = tools_ok and len(flags) == n_calls and all(bool(f) for f in flags)
    answer_ok = bool(find_tag_blocks(steps[-1], answer_tag))
    return prs_process_from_flags(tools_ok, answer_ok)


def _block_sequence(text: str) -> list[str] | None:
    """Tag names of a text that is only blocks `<t>…</t>` separated by whitespace.

    Each block closes at the first `</t>` after its `<t>`. Returns None when
    anything other than whitespace lies outside the blocks.
    """
    names = []
    pos = 0
    while True:
        opening = _OPENING_TAG.match(text, pos)
        if opening is None:
            return None if text[pos:].strip() else names
        name = opening.group(1)
        close = text.find(f"</{name}>", opening.end())
        if close < 0:
            return None
        names.append(name)
        pos = close + len(name) + 3


def prs_format_reward(
    step_texts: Sequence[str | None],
    *,
    reasoning_tag: str = "reasoning",
    answer_tag: str = "answer",
    tool_tag: str = "tool_call",
) -> float:
    """`R_format` of a trajectory's step texts (SPEC §7; `prs_vspo.txt` eq. 9).

    `R_format = 0.1` for a "complete label package" (every step's content
    correctly placed in its tags), else 0.

    Reading: a complete label package means every step is exactly a sequence
    of tag blocks with only whitespace outside them: a tool-call step is one
    `<reasoning>` block followed by one or more `<tool_call>` blocks; the final
    step is one `<reasoning>` block followed by one `<answer>` block. Each of
    the three tags occurs in a step only as those blocks' own open/close tags
    (no stray, nested or duplicated tags). Whether a tool call's JSON parses
    is `R_process`'s business, not this one's. An empty trajectory scores 0.

    Args:
      step_texts: the policy's step texts in order (`τ_1 … τ_n, τ_final`).
        Never raises on their content.
      reasoning_tag: the reasoning tag (`<reasoning>` in the paper's prompt).
      answer_tag: the final-answer tag.
      tool_tag: the tool-call block tag.

    Returns:
      0.1 or 0.0.

    Raises:
      ValueError: `step_texts` is a bare string or not a sequence.
    """
    steps = _check_steps(step_texts)
    if not steps:
        return 0.0
    for k, step in enumerate(steps):
        names = _block_sequence(step)
        if not names or names[0] != reasoning_tag:
            return 0.0
        final = k == len(steps) - 1
        rest = names[1:]
        if final and rest != [answer_tag]:
            return 0.0
        if not final and (not rest or any(n != tool_tag for n in rest)):
            return 0.0
        for tag in (reasoning_tag, answer_tag, tool_tag):
            if count_tag(step, tag) != (names.count(tag), names.count(tag)):
                return 0.0
    return FORMAT_REWARD


def prs_short_components(
    step_texts: Sequence[str | None],
    golds: str | Sequence[str],
    *,
    call_success: Sequence[bool] | None = None,
    reasoning_tag: str = "reasoning",
    answer_tag: str = "answer",
    tool_tag: str = "tool_call",
) -> dict[str, float]:
    """`PRS_short` of a trajectory and its components (`prs_vspo.txt` eq. 8–13).

    `process = R_process` (eq. 8), `format = R_format` (eq. 9),
    `answer = short_form_bleu(a, golds)` (eq. 10–12) with `a` the last
    `<answer>` content of the final step (0 when there is none), and
    `total = prs_short(process, format, answer)` (eq. 13).

    Args:
      step_texts: the policy's step texts in order. Never raises on their content.
      golds: one accepted answer or a list of them.
      call_success: optional execution flags, one per parsed tool call (see
        `prs_process_reward`).
      reasoning_tag: the reasoning tag.
      answer_tag: the final-answer tag.
      tool_tag: the tool-call block tag.

    Returns:
      `{"process", "format", "answer", "total"}`, all floats.
    """
    steps = _check_steps(step_texts)
    process = prs_process_reward(steps, call_success=call_success, answer_tag=answer_tag,
                                 tool_tag=tool_tag)
    fmt = prs_format_reward(steps, reasoning_tag=reasoning_tag, answer_tag=answer_tag,
                            tool_tag=tool_tag)
    answer = short_form_bleu(extract_tag(steps[-1], answer_tag) if steps else None, golds)
    return {"process": process, "format": fmt, "answer": answer,
            "total": prs_short(process, fmt, answer)}
