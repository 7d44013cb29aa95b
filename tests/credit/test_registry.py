"""The CreditScheme registry and the built-in schemes on a collated Batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl import credit
from agentrl.credit import registry
from agentrl.types import Batch
from tests.credit.fixtures import make_batch

BUILT_INS = ["checklist", "dr_grpo", "gae", "grpo", "mt_grpo", "mt_ppo", "segment", "tree"]


def test_built_ins_are_registered():
    assert set(BUILT_INS) <= set(credit.available_schemes())
    assert "vspo" in credit.available_transforms()
    assert credit.get_scheme("gae").needs_values == "token"
    assert credit.get_scheme("mt_ppo").needs_values == "token"
    assert credit.get_scheme("segment").needs_values == "boundary"
    assert credit.get_scheme("grpo").needs_values == "none"
    assert credit.get_scheme("dr_grpo").options["scale"] == "none"
    assert credit.get_scheme("dr_grpo").loss_aggregation == "seq_mean_token_sum_norm"
    assert credit.get_scheme("segment").loss_aggregation == "segment_mean_sum"


@pytest.mark.parametrize("name", BUILT_INS)
def test_built_in_runs_jitted_and_is_zero_off_policy(name):
    batch = make_batch(0)
    options = {"level": "step"} if name == "checklist" else {}
    output = credit.get_scheme(name).jit(**options)(batch)
    eager = credit.get_scheme(name)(batch, **options)
    advantages = np.asarray(output.advantages)
    assert advantages.shape == batch.tokens.shape
    assert np.isfinite(advantages).all()
    np.testing.assert_array_equal(advantages[~np.asarray(batch.loss_mask)], 0.0)
    assert np.abs(advantages).sum() > 0
    np.testing.assert_allclose(advantages, eager.advantages, atol=1e-5)
    assert set(output.metrics) >= {"adv_mean", "adv_abs_mean", "adv_zero_fraction"}


def _first_token_of_each_row(batch, values_per_token):
    first = np.argmax(np.asarray(batch.loss_mask), axis=1)
    return np.asarray(values_per_token)[np.arange(batch.batch_size), first]


def test_grpo_scheme_equals_grpo_advantages():
    batch = make_batch(1)
    output = credit.get_scheme("grpo")(batch)
    expected = credit.grpo_advantages(batch.grouped(batch.outcome)).reshape(-1)
    np.testing.assert_allclose(_first_token_of_each_row(batch, output.advantages), expected,
                               atol=1e-6)
    # Every policy token of a row carries its trajectory advantage.
    adv = np.asarray(output.advantages)
    for row in range(batch.batch_size):
        policy = np.asarray(batch.loss_mask[row])
        np.testing.assert_allclose(adv[row, policy], expected[row], atol=1e-6)


def test_mt_grpo_scheme_puts_turn_advantages_on_turn_tokens():
    batch = make_batch(2)
    output = credit.get_scheme("mt_grpo")(batch)
    per_turn = np.asarray(credit.mt_grpo_advantages(
        batch.grouped(batch.turn_rewards), batch.grouped(batch.turn_mask),
        batch.grouped(batch.outcome))).reshape(batch.batch_size, -1)
    turn_id = np.asarray(batch.turn_id)
    adv = np.asarray(output.advantages)
    for row, t in zip(*np.nonzero(np.asarray(batch.loss_mask)), strict=True):
        assert adv[row, t] == pytest.approx(per_turn[row, turn_id[row, t]], abs=1e-6)


def test_gae_scheme_rewards_the_last_policy_token_and_returns():
    batch = make_batch(3)
    output = credit.get_scheme("gae")(batch, whiten=False, lambda_=1.0)
    # γ = λ = 1 with the reward at the last policy token: A_t = R − V_t.
    mask = np.asarray(batch.loss_mask)
    expected = np.asarray(batch.outcome)[:, None] - np.asarray(batch.values)
    np.testing.assert_allclose(np.asarray(output.advantages)[mask], expected[mask], atol=1e-5)
    outcome = np.broadcast_to(np.asarray(batch.outcome)[:, None], mask.shape)
    np.testing.assert_allclose(np.asarray(output.returns)[mask], outcome[mask], atol=1e-5)


def test_segment_scheme_uses_boundary_values():
    batch = make_batch(4)
    output = credit.get_scheme("segment")(batch)
    per_step = np.asarray(credit.segment_advantages(
        batch.boundary_values, batch.step_mask, batch.outcome))
    step_id = np.asarray(batch.step_id)
    adv = np.asarray(output.advantages)
    for row, t in zip(*np.nonzero(np.asarray(batch.loss_mask)), strict=True):
        assert adv[row, t] == pytest.approx(per_step[row, step_id[row, t]], abs=1e-6)


def test_checklist_levels_differ_and_trajectory_level_matches_function():
    batch = make_batch(5)
    scheme = credit.get_scheme("checklist")
    levels = {level: np.asarray(scheme(batch, level=level).advantages)
              for level in ("trajectory", "turn", "step")}
    assert not np.allclose(levels["trajectory"], levels["step"])
    direct = credit.checklist_credit(
        batch.grouped(batch.checklist_sat_after), batch.grouped(batch.checklist_deps),
        batch.grouped(batch.checklist_weights), batch.grouped(batch.checklist_step_mask),
        batch.grouped(batch.checklist_item_mask),
        batch.grouped(batch.checklist_step_mask.any(-1)))
    np.testing.assert_allclose(_first_token_of_each_row(batch, levels["trajectory"]),
                               np.asarray(direct.traj_adv).reshape(-1), atol=1e-6)


def test_padding_rows_get_zero_and_do_not_change_others():
    batch = make_batch(6)
    base = np.asarray(credit.get_scheme("grpo")(batch).advantages)
    row_mask = np.ones(batch.batch_size, bool)
    row_mask[2] = False  # drop the last member of group 0
    masked = np.asarray(credit.get_scheme("grpo")(batch.replace(row_mask=jnp.asarray(row_mask)))
                        .advantages)
    np.testing.assert_array_equal(masked[2], 0.0)
    np.testing.assert_allclose(masked[3:], base[3:], atol=1e-6)  # other group unchanged


def test_vspo_transform_gathers_groups_and_weights_rows():
    batch = make_batch(7, num_groups=4, group_size=2)
    outcome = np.array([1.0, 1.0, 0.0, 1.0, -1.0, -1.0, 1.0, -1.0], np.float32)
    batch = batch.replace(outcome=jnp.asarray(outcome))
    new_batch, output = credit.compute_credit(batch, "grpo", transform="vspo",
                                              key=jax.random.key(0))
    live = np.array([False, True, False, True])
    slot_to_group, slot_weight = credit.vspo_resample(outcome.reshape(4, 2), jax.random.key(0))
    slot_to_group = np.asarray(slot_to_group)
    assert live[slot_to_group].all()  # every slot holds a live group now
    np.testing.assert_array_equal(np.asarray(new_batch.grouped(new_batch.tokens)),
                                  np.asarray(batch.grouped(batch.tokens))[slot_to_group])
    np.testing.assert_allclose(np.asarray(output.row_weights),
                               np.repeat(np.asarray(slot_weight), 2), atol=1e-6)


def test_errors_name_the_problem():
    with pytest.raises(KeyError, match="unknown credit scheme 'grpoo'"):
        credit.get_scheme("grpoo")
    with pytest.raises(ValueError, match=r"no option\(s\) \['temperature'\]"):
        credit.get_scheme("grpo")(make_batch(0), temperature=1.0)
    with pytest.raises(ValueError, match="already registered"):
        credit.register_scheme("grpo")(registry.grpo_scheme)
    with pytest.raises(ValueError, match="needs Batch fields \\['values'\\]"):
        credit.get_scheme("gae")(make_batch(0, values=False))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        credit.compute_credit(make_batch(0), "grpo", transform="vspo")
    with pytest.raises(ValueError, match="level='turns'"):
        credit.get_scheme("checklist")(make_batch(0), level="turns")


def test_register_scheme_requires_defaults_for_options():
    with pytest.raises(TypeError, match="needs a default"):
        @credit.register_scheme("no_default_scheme")
        def no_default(batch: Batch, *, scale):
            return None
    assert "no_default_scheme" not in credit.available_schemes()


def test_checklist_reference_normalizer_needs_every_reference_turn_count():
    batch = make_batch(8)
    scheme = credit.get_scheme("checklist")
    assert np.isfinite(np.asarray(scheme(batch, turn_normalizer="reference").advantages)).all()
    with pytest.raises(ValueError, match="reference_turns"):
        scheme(batch.replace(reference_turns=None), turn_normalizer="reference")
