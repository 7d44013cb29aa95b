"""Answer normalisation, exact match, answer presence and `\\boxed{}` extraction.

`normalize_answer` is the SQuAD v1.1 evaluation normalisation, which Search-R1
and the MT-PPO reward (`turn_level_credit_mt_grpo_mt_ppo.txt` §5.2) use for
exact match and PRS (`prs_vspo.txt`, short-form BLEU) uses before tokenising.
"""

import re
import string
from collections.abc import Sequence

from agentrl.rewards.parsing import as_text

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
_BRACES = re.compile(r"[{}]")


def as_golds(golds: str | Sequence[str]) -> list[str]:
    """Accepted answers as a list; a single `str` is one accepted answer.

    Args:
      golds: one accepted answer or a non-empty sequence of them.

    Returns:
      The accepted answers as a list of `str`.

    Raises:
      ValueError: `golds` is empty or holds a non-`str` (a dataset or caller
        bug: the reward would silently be 0 for every rollout).
    """
    if isinstance(golds, str):
        return [golds]
    if not isinstance(golds, Sequence) or isinstance(golds, bytes):
        raise ValueError(
            f"golds must be a str or a sequence of str, got {type(golds).__name__} "
            f"{golds!r:.80}; pass the accepted answers, e.g. ['Paris']"
        )
    golds = list(golds)
    if not golds:
        raise ValueError("golds is empty ([]); pass at least one accepted answer")
    bad = [g for g in golds if not isinstance(g, str)]
    if bad:
        raise ValueError(
            f"golds must hold only str, got {type(bad[0]).__name__} {bad[0]!r:.80}; "
            "convert the accepted answers to strings"
        )
    return golds


def normalize_answer(text: str | None) -> str:
    """SQuAD answer normalisation.

    `white_space_fix(remove_articles(remove_punc(lower(text))))`: lower case,
    delete ASCII punctuation (`string.punctuation`), replace the words
    a / an / the by a space, collapse whitespace runs to one space and strip.

    Args:
      text: an answer string (model output; never raises on it).

    Returns:
      The normalised answer (possibly `""`).
    """
    text = as_text(text).lower()
    text = text.translate(_DROP_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """SQuAD exact match: `max_g 1[normalize(prediction) == normalize(g)]`.

    Args:
      prediction: the extracted answer (e.g. the `<answer>` content). `None`
        (no answer extracted) scores 0.
      golds: one accepted answer or a list of them.

    Returns:
      1.0 or 0.0.
    """
    golds = as_golds(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def answer_in_text(text: str | None, golds: str | Sequence[str]) -> bool:
    """Case-insensitive substring presence: does any accepted answer occur in `text`?

    Used by the MT-PPO retrieval reward (§5.2) and the MT-GRPO answer-presence
    rewards (App. D.2), which both specify "case-insensitive" matching.

    Reading: comparison is `g.strip().casefold() in text.casefold()`; accepted
    answers that are empty after stripping are skipped (the empty string is a
    substring of everything and would always score).

    Args:
      text: the text searched (model answer or retrieved documents; never
        raises on it). `None` holds nothing.
      golds: one accepted answer or a list of them.

    Returns:
      True iff some non-empty accepted answer occurs in `text`.
    """
    golds = as_golds(golds)
    haystack = as_text(text).casefold()
    return any(g.strip() and g.strip().casefold() in haystack for g in golds)


def extract_boxed(text: str | None) -> str | None:
    """Content of the last `\\boxed{…}` (or `\\fbox{…}`), nested braces included.

    Brace matching counts every `{` and `}` after the command (as the MATH
    benchmark's `last_boxed_only_string` does); the content is returned
    stripped.

    Args:
      text: model output (never raises on it).

    Returns:
      The content of the last `\\boxed{…}`, or `None` when there is none or its
      braces are unbalanced.
    """
    text = as_text(text)
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_brace = text.index("{", start)
    depth = 0
    for brace in _BRACES.finditer(text, open_brace):
        depth += 1 if brace.group(0) == "{" else -1
        if depth == 0:
            return text[open_brace + 1 : brace.start()].strip()
    return None
