"""Every entry of spec_examples.json (SPEC §11), jitted and not, float32 and float64.

The expected values are read from the file, never copied here. Tolerances:
1e-5 in float32, 1e-6 in float64 (the issue's contract).
"""

import functools

import jax
import numpy as np
import pytest

from agentrl import credit, losses, rewards
from tests import spec_examples

EXAMPLES = spec_examples.load()
MODES = ["eager32", "jit32", "eager64", "jit64"]
TOLERANCE = {"32": 1e-5, "64": 1e-6}


def _call(fn, mode, *args, **options):
    """fn(*args, **options), jitted with the options static in the jit modes."""
    if mode.startswith("jit"):
        return jax.jit(functools.partial(fn, **options))(*args)
    return fn(*args, **options)


def _close(actual, expected, mode, what):
    tol = TOLERANCE[mode[-2:]]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64),
        rtol=0, atol=tol, err_msg=what,
    )


def check_grpo(example, mode):
    rewards_ = np.asarray(example["inputs"]["rewards"])
    out = _call(credit.grpo_advantages, mode, rewards_, **example["options"])
    _close(out, example["expected"]["advantages"], mode, "advantages")


def check_mt_grpo(example, mode):
    i = example["inputs"]
    args = [np.asarray(i[k]) for k in ("turn_rewards", "turn_mask", "outcome")]
    out = _call(credit.mt_grpo_advantages, mode, *args, **example["options"])
    _close(out, example["expected"]["advantages"], mode, "advantages")


def check_gae(example, mode):
    i = example["inputs"]
    args = [np.asarray(i[k]) for k in ("rewards", "values", "mask")]
    advantages, returns = _call(credit.gae_advantages, mode, *args, **example["options"])
    _close(advantages, example["expected"]["advantages"], mode, "advantages")
    _close(returns, example["expected"]["returns"], mode, "returns")


def check_checklist(example, mode):
    i = example["inputs"]
    names = ("sat_after", "deps", "weights", "step_mask", "item_mask", "turn_mask")
    args = [np.asarray(i[k]) for k in names]
    options = dict(example["options"])

    def fn(*arrays, **opts):
        *arrays, reference_turns = arrays
        return credit.checklist_credit(*arrays, reference_turns=reference_turns, **opts)

    reference = np.asarray(i.get("reference_turns", np.zeros(args[0].shape[0])))
    out = _call(fn, mode, *args, reference, **options)
    for field, expected in example["expected"].items():
        _close(getattr(out, field), expected, mode, field)


def check_tree(example, mode):
    i = example["inputs"]
    names = ("node_id", "step_mask", "outcome", "fmt_score", "step_tokens")
    out = _call(credit.tree_credit, mode, *[np.asarray(i[k]) for k in names], **example["options"])
    for field, expected in example["expected"].items():
        _close(getattr(out, field), expected, mode, field)


def check_segment(example, mode):
    i = example["inputs"]
    args = [np.asarray(i[k]) for k in ("values", "seg_mask", "reward")]
    out = _call(credit.segment_advantages, mode, *args, **example["options"])
    _close(out, example["expected"]["advantages"], mode, "advantages")


def check_segment_critic_loss(example, mode):
    i = example["inputs"]
    args = [np.asarray(i[k]) for k in ("values", "seg_mask", "reward")]
    _close(_call(credit.segment_critic_loss, mode, *args), example["expected"], mode, "loss")


def check_vspo(example, mode):
    rewards_ = np.asarray(example["inputs"]["rewards"])
    expected = example["expected"]
    value, variance = _call(credit.vspo_value_scores, mode, rewards_)
    _close(value, expected["value"], mode, "value")
    _close(variance, expected["variance"], mode, "variance")
    probs, live = _call(credit.vspo_probabilities, mode, rewards_, **example["options"])
    _close(probs, expected["probs"], mode, "probs")
    np.testing.assert_array_equal(np.asarray(live), expected["live"])
    for case in example["slot_weight_cases"]:
        weights = _call(
            credit.vspo_slot_weights, mode, np.asarray(case["slot_to_group"]), alpha=case["alpha"]
        )
        _close(weights, case["expected"], mode, f"slot weights {case}")


def check_ppo_loss(example, mode):
    i = example["inputs"]
    expected = example["expected"]
    args = [np.asarray(i[k]) for k in ("logp", "old_logp", "advantages")]
    per_token = _call(losses.ppo_clip_loss, mode, *args)
    _close(per_token, expected["per_token"], mode, "per_token")
    dual = _call(losses.ppo_clip_loss, mode, *args, clip_high=0.28, dual_clip=3.0)
    _close(dual, expected["per_token_clip_high_0_28_dual_3"], mode, "clip-high + dual clip")
    mask, segment_ids = np.asarray(i["mask"]), np.asarray(i["segment_ids"])
    for aggregation in losses.AGGREGATIONS:
        value = _call(
            lambda pt, m, s, mode_=aggregation: losses.aggregate_loss(
                pt, m, mode_, segment_ids=s, norm_length=4
            ),
            mode, np.asarray(expected["per_token"]), mask, segment_ids,
        )
        _close(value, expected[aggregation], mode, aggregation)


def check_kl(example, mode):
    i = example["inputs"]
    args = [np.asarray(i[k]) for k in ("logp", "ref_logp")]
    for kind, expected in example["expected"].items():
        _close(_call(losses.kl_divergence, mode, *args, kind=kind), expected, mode, kind)


def check_portool_format(example, mode):
    for case in example["cases"]:
        score = rewards.portool_format_score_from_flags(**case["inputs"])
        _close(score, case["expected"], mode, str(case["inputs"]))


def check_short_form_bleu_tokens(example, mode):
    for case in example["cases"]:
        score = rewards.short_form_bleu_tokens(case["pred"], case["ref"])
        _close(score, case["expected"], mode, f"{case['pred']} vs {case['ref']}")


def check_prs(example, mode):
    for case in example["cases"]:
        score = getattr(rewards, case["fn"])(*case["args"])
        _close(score, case["expected"], mode, f"{case['fn']}{tuple(case['args'])}")


# Longest matching prefix wins (e.g. "segment_critic_loss" before "segment").
CHECKERS = {
    "grpo": check_grpo,
    "mt_grpo": check_mt_grpo,
    "gae_": check_gae,
    "checklist_": check_checklist,
    "tree_": check_tree,
    "segment_lambda_": check_segment,
    "segment_critic_loss": check_segment_critic_loss,
    "vspo": check_vspo,
    "ppo_loss": check_ppo_loss,
    "kl": check_kl,
    "portool_format": check_portool_format,
    "short_form_bleu_tokens": check_short_form_bleu_tokens,
    "prs": check_prs,
}


def checker_for(key):
    matches = [prefix for prefix in CHECKERS if key.startswith(prefix)]
    return CHECKERS[max(matches, key=len)] if matches else None


def test_every_entry_has_a_checker():
    unchecked = [key for key in EXAMPLES if checker_for(key) is None]
    assert not unchecked, f"spec_examples.json entries without a checker: {unchecked}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_spec_example(key, mode):
    check = checker_for(key)
    if mode.endswith("64"):
        with jax.enable_x64(True):
            check(EXAMPLES[key], mode)
    else:
        check(EXAMPLES[key], mode)
