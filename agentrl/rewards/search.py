"""MT-PPO search-agent rewards (SPEC §4; `turn_level_credit_mt_grpo_mt_ppo.txt` §5.2).

The agent follows Search-R1's tags (§5.1): reasoning in `<think>`, a query in
`<search>`, the retriever's documents inserted by the environment in
`<information>`, the final answer in `<answer>`. A trajectory is a list of
turn texts; an intermediate turn's text is the policy's generation
(`<think>…</think><search>…</search>`) followed by the environment's
`<information>…</information>` insert, and the final turn's text is the
policy's last generation (`<think>…</think><answer>…</answer>`).

Placement (SPEC §4): `R^F` goes on the last policy token of the trajectory and
`R^I_k` on the last policy token of turn k < K; that is the credit module's
job, these functions only score text.
"""

from collections.abc import Sequence

from agentrl.rewards.answers import answer_in_text, as_golds, exact_match
from agentrl.rewards.parsing import (
    TagToken,
    as_text,
    extract_tag,
    find_tag_blocks,
    tag_tokens,
)

FINAL_FORMAT_OK = 0.2
FINAL_FORMAT_BAD = -1.0
RETRIEVAL_REWARD = 0.3
INTERMEDIATE_FORMAT_OK = 0.1
INTERMEDIATE_FORMAT_BAD = -0.2
SEARCH_PENALTY = 0.1

_FINAL_TAGS = ("think", "answer")
_INTERMEDIATE_TAGS = ("think", "search", "information")


def _outside_block(tokens: list[TagToken], text: str, tag: str) -> list[TagToken]:
    """Tokens not inside the content of the first complete `<tag>…</tag>` block."""
    start = text.find(f"<{tag}>")
    end = text.find(f"</{tag}>", start) if start >= 0 else -1
    if end < 0:
        return tokens
    inner_start = start + len(tag) + 2
    return [t for t in tokens if not (t.start >= inner_start and t.end <= end)]


def _layout_ok(text: str, tags: Sequence[str], opaque: str | None = None) -> bool:
    """Only `tags` appear, each as exactly one `<t>` and one `</t>`, `<t>` before
    `</t>`, and the first tag's block closes before any other tag opens.

    Tags inside the content of the `opaque` block (environment text) are ignored.
    """
    tokens = tag_tokens(text)
    if opaque is not None:
        tokens = _outside_block(tokens, text, opaque)
    if any(not t.canonical or t.name not in tags for t in tokens):
        return False
    opens, closes = {}, {}
    for t in tokens:
        side = closes if t.closing else opens
        if t.name in side:
            return False
        side[t.name] = t.start
    if len(opens) != len(tags) or len(closes) != len(tags):
        return False
    if any(opens[tag] > closes[tag] for tag in tags):
        return False
    return all(closes[tags[0]] < opens[tag] for tag in tags[1:])


def mt_ppo_final_format_ok(text: str | None) -> bool:
    """Final-turn format check of MT-PPO (§5.2, "Final Format Reward").

    True iff (1) only `<think>` and `<answer>` tags appear, (2) each exactly
    once, (3) `<think>` precedes `<answer>`.

    Reading: "each tag appears exactly once" means exactly one opening and
    one closing tag each, opening before closing; "precedes" means the
    `<think>` block closes before `<answer>` opens (no nesting). A "tag" is
    any `<name …>` / `</name>` token; one written with attributes or a
    self-closing slash counts as an extra tag. Text outside the tags is
    allowed.

    Args:
      text: the final turn's policy text (never raises on it).

    Returns:
      Whether the format is correct.
    """
    return _layout_ok(as_text(text), _FINAL_TAGS)


def mt_ppo_intermediate_format_ok(turn_text: str | None) -> bool:
    """Intermediate-turn format check of MT-PPO (§5.2, "Intermediate Format Reward").

    True iff (1) only `<think>`, `<search>`, `<information>` appear, (2) each
    exactly once, (3) `<think>` precedes `<search>` and `<information>`.

    Reading: as in `mt_ppo_final_format_ok` (one opening and one closing tag
    each; the `<think>` block closes before the others open). Tags inside the
    `<information>` content are the retriever's documents, not the policy's
    output, and are ignored.

    Args:
      turn_text: the turn's policy text plus its `<information>` insert (never
        raises on it).

    Returns:
      Whether the format is correct.
    """
    return _layout_ok(as_text(turn_text, "turn_text"), _INTERMEDIATE_TAGS, opaque="information")


def count_searches(turn_text: str | None) -> int:
    """Number of search invocations in a turn: complete `<search>…</search>` blocks.

    Args:
      turn_text: the turn's text (never raises on it).

    Returns:
      The count.
    """
    return len(find_tag_blocks(turn_text, "search"))


def mt_ppo_final_components(text: str | None, golds: str | Sequence[str]) -> dict[str, float]:
    """Components of the MT-PPO final reward `R^F` (SPEC §4; §5.2).

    `em = R^F_EM` = 1.0 if the last `<answer>` content exactly matches an
    accepted answer after SQuAD normalisation (`exact_match`), else 0;
    `format = R^F_format` = 0.2 if `mt_ppo_final_format_ok`, else −1.0;
    `total = em + format`.

    Reading: the paper's "normalization (e.g., lowercasing and whitespace
    removal)" is read as Search-R1's SQuAD normalisation (`normalize_answer`),
    which MT-PPO's setup follows (App. B.2). EM is scored whether or not the
    format passes (the two terms add, §5.2); no `<answer>` block scores EM 0.

    Args:
      text: the final turn's policy text (never raises on it).
      golds: one accepted answer or a list of them.

    Returns:
      `{"em", "format", "total"}`.
    """
    text = as_text(text)
    em = exact_match(extract_tag(text, "answer"), golds)
    fmt = FINAL_FORMAT_OK if mt_ppo_final_format_ok(text) else FINAL_FORMAT_BAD
    return {"em": em, "format": fmt, "total": em + fmt}


def mt_ppo_final_reward(text: str | None, golds: str | Sequence[str]) -> float:
    """MT-PPO final reward `R^F = R^F_EM + R^F_format` (SPEC §4; §5.2).

    See `mt_ppo_final_components` for the terms and readings.

    Args:
      text: the final turn's policy text (never raises on it).
      golds: one accepted answer or a list of them.

    Returns:
      `R^F` ∈ {−1.0, 0.0, 0.2, 1.2}.
    """
    return mt_ppo_final_components(text, golds)["total"]


def mt_ppo_intermediate_components(
    turn_text: str | None, golds: str | Sequence[str], num_searches_so_far: int
) -> dict[str, float]:
    """Components of the MT-PPO intermediate reward `R^I_k` (SPEC §4; §5.2).

    `retrieval = R^I_retrieval` = 0.3 if any accepted answer occurs
    case-insensitively in this turn's `<information>` content, else 0;
    `format = R^I_format` = 0.1 if `mt_ppo_intermediate_format_ok`, else −0.2;
    `search = R^I_search = −0.1 · n_search`; `total` = their sum.

    Reading: `n_search` is "the cumulative number of search invocations from
    the first turn up to the current turn", this turn included (a first turn
    with one search gets −0.1). Retrieval looks at every complete
    `<information>` block of the turn and skips empty accepted answers
    (`answer_in_text`).

    Args:
      turn_text: the turn's policy text plus its `<information>` insert (never
        raises on it).
      golds: one accepted answer or a list of them.
      num_searches_so_far: `n_search`, searches in turns 1…k (≥ 0).

    Returns:
      `{"retrieval", "format", "search", "total"}`.

    Raises:
      ValueError: `num_searches_so_far` is not a non-negative integer.
    """
    if isinstance(num_searches_so_far, bool) or not isinstance(num_searches_so_far, int) \
            or num_searches_so_far < 0:
        raise ValueError(
            f"num_searches_so_far must be a non-negative int, got {num_searches_so_far!r}; "
            "pass the cumulative number of searches in turns 1..k (see count_searches)"
        )
    turn_text = as_text(turn_text, "turn_text")
    golds = as_golds(golds)
    found = any(answer_in_text(block, golds) for block in find_tag_blocks(turn_text, "information"))
    retrieval = RETRIEVAL_REWARD if found else 0.0
    fmt = INTERMEDIATE_FORMAT_OK if mt_ppo_intermediate_format_ok(turn_text) \
        else INTERMEDIATE_FORMAT_BAD
    search = -SEARCH_PENALTY * num_searches_so_far
    return {"retrieval": retrieval, "format": fmt, "search": search,
            "total": retrieval + fmt + search}


def mt_ppo_intermediate_reward(
    turn_text: str | None, golds: str | Sequence[str], num_searches_so_far: int
) -> float:
    """MT-PPO intermediate reward `R^I = R^I_retrieval + R^I_format + R^I_search` (§5.2).

    See `mt_ppo_intermediate_components` for the terms and readings.

    Args:
      turn_text: the turn's policy text plus its `<information>` insert (never
        raises on it).
      golds: one accepted answer or a list of them.
      num_searches_so_far: cumulative searches in turns 1…k (≥ 0).

    Returns:
      `R^I_k`.
    """
    return mt_ppo_intermediate_components(turn_text, golds, num_searches_so_far)["total"]


def mt_ppo_trajectory_rewards(
    turn_texts: Sequence[str | None], golds: str | Sequence[str]
) -> tuple[list[float], float]:
    """All MT-PPO rewards of one trajectory: `([R^I_1 … R^I_{K−1}], R^F)` (§5.2).

    Turns 1…K−1 get `mt_ppo_intermediate_reward` with `n_search` the running
    total of `count_searches` over turns 1…k; turn K gets
    `mt_ppo_final_reward`.

    Args:
      turn_texts: the K ≥ 1 turn texts in order (never raises on their content).
      golds: one accepted answer or a list of them.

    Returns:
      `(intermediate, final)`: K−1 intermediate rewards and `R^F`.

    Raises:
      ValueError: `turn_texts` is empty, a bare string, or not a sequence.
    """
    if isinstance(turn_texts, str | bytes) or not isinstance(turn_texts, Sequence) \
            or not turn_texts:
        raise ValueError(
            f"turn_texts must be a non-empty sequence of turn strings, got {turn_texts!r:.80}; "
            "pass [turn_1, ..., turn_K]"
        )
    intermediate = []
    n_search = 0
    for turn in turn_texts[:-1]:
        n_search += count_searches(turn)
        intermediate.append(mt_ppo_intermediate_reward(turn, golds, n_search))
    return intermediate, mt_ppo_final_reward(turn_texts[-1], golds)
