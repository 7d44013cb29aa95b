"""Short-form BLEU, the PRS answer reward R_a (SPEC §7; `prs_vspo.txt` eq. 10–12)."""

import math
from collections import Counter
from collections.abc import Sequence

from agentrl.rewards.answers import as_golds, normalize_answer


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _clipped_precision(pred: Sequence[str], ref: Sequence[str], n: int) -> float:
    """Modified n-gram precision: Σ min(count_pred, count_ref) / #pred n-grams."""
    pred_counts = _ngrams(pred, n)
    ref_counts = _ngrams(ref, n)
    matched = sum(min(count, ref_counts[gram]) for gram, count in pred_counts.items())
    return matched / (len(pred) - n + 1)


def short_form_bleu_tokens(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    """Short-form BLEU of one prediction against one reference (SPEC §7).

    `BLEU = BP · exp(Σ_{n=1}^{max_n} w_n log p_n)` with `c = len(pred)`,
    `r = len(ref)`, `max_n = min(4, c)` (eq. 11), `w_n = 1/max_n` (eq. 12),
    `p_n` the clipped (modified) n-gram precision, and brevity penalty
    `BP = 1 if c > r else exp(1 − r/c)` (eq. 10). BLEU = 0 when `c = 0` or any
    used `p_n = 0`. An exact match of any length ≥ 1 scores 1; in particular a
    1–3 token answer is not penalised for lacking 4-grams, which is the point
    of the paper's change (`prs_vspo.txt`, "Answer reward R_a").

    No normalisation or tokenisation happens here: tokens are compared as
    given (use `short_form_bleu` for text).

    Args:
      pred_tokens: predicted answer tokens, length c.
      ref_tokens: reference answer tokens, length r.

    Returns:
      BLEU in [0, 1].
    """
    pred, ref = list(pred_tokens), list(ref_tokens)
    c, r = len(pred), len(ref)
    if c == 0:
        return 0.0
    max_n = min(4, c)
    log_sum = 0.0
    for n in range(1, max_n + 1):
        p_n = _clipped_precision(pred, ref, n)
        if p_n == 0.0:
            return 0.0
        log_sum += math.log(p_n) / max_n
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return brevity * math.exp(log_sum)


def short_form_bleu(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Short-form BLEU of an answer string, max over accepted answers (SPEC §7).

    `max_g short_form_bleu_tokens(split(normalize(prediction)), split(normalize(g)))`
    with `normalize_answer` (lower case, strip punctuation and articles,
    collapse whitespace) and whitespace tokenisation.

    Reading: several golds are scored one at a time and the maximum is taken
    (SPEC §7), not BLEU's multi-reference clipping.

    Args:
      prediction: the extracted answer text (e.g. the `<answer>` content);
        `None` (no answer extracted) scores 0. Never raises on it.
      golds: one accepted answer or a list of them.

    Returns:
      BLEU in [0, 1].
    """
    golds = as_golds(golds)
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    return max(short_form_bleu_tokens(pred_tokens, normalize_answer(g).split()) for g in golds)
