"""The jitted update: sharded equals single-device; non-finite steps are skipped; SFT."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl import parallel
from agentrl.models.config import model_config
from agentrl.train.loop import _boxed_state_shardings
from agentrl.train.state import ModelSpec, OptimizerConfig, build_optimizers, init_train_state
from agentrl.train.step import (
    LossConfig,
    TrainBatch,
    compute_logprobs,
    ppo_update,
    sft_loss,
    sft_update,
)

CONFIG = model_config("tiny", vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
OPTIMIZERS = {"actor": OptimizerConfig(1e-3), "critic": OptimizerConfig(1e-3),
              "critic_backbone": OptimizerConfig(1e-4)}


def make_batch(spec, params, rows=8, length=16, seed=0, critic="none"):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 128, (rows, length)))
    segment_ids = jnp.ones((rows, length), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None, :] >= 6).repeat(rows, 0)
    old = compute_logprobs(spec, params, tokens, segment_ids)
    extra = {}
    if critic == "token":
        extra = dict(returns=jnp.asarray(rng.normal(size=(rows, length)), jnp.float32),
                     old_values=jnp.zeros((rows, length)))
    if critic == "boundary":
        extra = dict(critic_positions=jnp.tile(jnp.array([[6, 11]]), (rows, 1)),
                     critic_weights=jnp.ones((rows, 2)) / 2,
                     critic_targets=jnp.asarray(rng.integers(0, 2, (rows, 2)), jnp.float32))
    return TrainBatch(tokens, segment_ids, mask, jnp.where(mask, 0, -1),
                      jnp.asarray(rng.normal(size=(rows, length)), jnp.float32), old, old,
                      jnp.ones(rows), **extra)


def run_update(spec, loss, mesh, batch, epochs=2, minibatches=2):
    txs = build_optimizers(spec, OPTIMIZERS)
    shardings, _ = _boxed_state_shardings(spec, txs, mesh, parallel.DEFAULT_RULES)
    with jax.set_mesh(mesh):
        import flax.linen as nn

        with nn.logical_axis_rules(parallel.DEFAULT_RULES):
            state = jax.jit(lambda k: init_train_state(spec, txs, k),
                            out_shardings=shardings)(jax.random.key(0))
            update = jax.jit(functools.partial(ppo_update, spec, loss, txs, epochs=epochs,
                                               num_minibatches=minibatches),
                             out_shardings=(shardings, None), donate_argnums=(0,))
            return update(state, batch)


VALUE_MODES = [("none", "none"), ("shared", "boundary"), ("separate", "token")]
MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]


def _mesh_cases():
    """Every mesh × value mode; the default run covers each mesh and each mode once."""
    for i, shape in enumerate(MESHES):
        for j, (value, critic) in enumerate(VALUE_MODES):
            marks = () if i == j else (pytest.mark.slow,)
            yield pytest.param(shape, value, critic, marks=marks,
                               id=f"{'x'.join(map(str, shape))}-{value}-{critic}")


@pytest.mark.parametrize("shape,value,critic", list(_mesh_cases()))
def test_update_on_8_devices_equals_1_device(shape, value, critic):
    spec = ModelSpec(CONFIG, value=value, head="carl" if value == "shared" else "linear")
    loss = LossConfig(critic=critic, kl_coef=0.0, entropy_coef=0.01)
    one = parallel.make_mesh(parallel.MeshConfig(1, 1, 1))
    state_one, metrics_one = run_update(spec, loss, one, _batch_for(spec))
    many = parallel.make_mesh(parallel.MeshConfig(*shape))
    state_many, metrics_many = run_update(spec, loss, many, _batch_for(spec))
    for key in metrics_one:
        np.testing.assert_allclose(metrics_many[key], metrics_one[key], rtol=1e-5, atol=1e-5)
    leaves_one = jax.tree_util.tree_leaves(state_one.params)
    leaves_many = jax.tree_util.tree_leaves(state_many.params)
    for a, b in zip(leaves_one, leaves_many, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    kernel = state_many.params["policy"]["layers"]["layer"]["mlp"]["gate_proj"]["kernel"]
    assert len(kernel.sharding.device_set) == 8


@functools.cache
def _batch_for(spec):
    params = init_train_state(spec, {}, jax.random.key(0)).params
    critic = {"none": "none", "shared": "boundary", "separate": "token"}[spec.value]
    return make_batch(spec, params, critic=critic)


def test_non_finite_steps_are_skipped_and_counted():
    spec = ModelSpec(CONFIG)
    txs = build_optimizers(spec, {"actor": OptimizerConfig(1e-3)})
    state = init_train_state(spec, txs, jax.random.key(0))
    batch = make_batch(spec, state.params)
    poisoned = batch.replace(advantages=batch.advantages.at[0, 8].set(jnp.nan))
    before = jax.tree_util.tree_map(np.asarray, state.params)
    update = jax.jit(functools.partial(ppo_update, spec, LossConfig(), txs))
    state, metrics = update(state, poisoned)
    assert int(state.skipped) == 1 and int(state.step) == 0
    assert metrics["finite"] == 0.0
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state.params),
                    strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    state, metrics = update(state, batch)
    assert int(state.step) == 1 and metrics["finite"] == 1.0


def test_sft_lowers_the_loss_on_a_fixed_batch():
    spec = ModelSpec(CONFIG)
    tx = OptimizerConfig(3e-3).build()
    state = init_train_state(spec, {"actor": tx}, jax.random.key(1))
    batch = make_batch(spec, state.params)
    update = jax.jit(functools.partial(sft_update, spec, tx))
    losses = []
    for _ in range(20):
        state, metrics = update(state, batch.tokens, batch.segment_ids, batch.loss_mask)
        losses.append(float(metrics["sft_loss"]))
    assert losses[-1] < 0.7 * losses[0]


def test_sft_loss_with_a_fixed_normaliser_adds_up_across_length_buckets():
    """Two one-bucket batches normalised by the same count = one mixed batch."""
    spec = ModelSpec(CONFIG)
    params = init_train_state(spec, {"actor": OptimizerConfig(1e-3).build()},
                              jax.random.key(2)).params
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 128, (6, 16)))
    segments = jnp.ones((6, 16), jnp.int32)
    lengths = np.array([6, 7, 6, 16, 15, 16])  # short rows, then long rows
    mask = jnp.asarray((np.arange(16)[None] >= 4) & (np.arange(16)[None] < lengths[:, None]))
    norm = jnp.float32(mask.sum())

    def loss(p, rows, width, norm_tokens):
        return sft_loss(spec, {"policy": p}, tokens[rows, :width], segments[rows, :width],
                        mask[rows, :width], None, norm_tokens)

    full, full_grad = jax.value_and_grad(loss)(params["policy"], slice(0, 6), 16, None)
    assert float(loss(params["policy"], slice(0, 6), 16, norm)) == pytest.approx(float(full))
    short, short_grad = jax.value_and_grad(loss)(params["policy"], slice(0, 3), 8, norm)
    long, long_grad = jax.value_and_grad(loss)(params["policy"], slice(3, 6), 16, norm)
    assert float(short + long) == pytest.approx(float(full), rel=1e-5)
    summed = jax.tree_util.tree_map(jnp.add, short_grad, long_grad)
    for a, b in zip(jax.tree_util.tree_leaves(summed), jax.tree_util.tree_leaves(full_grad),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Each batch's own token mean would weight the short batch's tokens more.
    own = loss(params["policy"], slice(0, 3), 8, None) + loss(params["policy"], slice(3, 6), 16,
                                                             None)
    assert abs(float(own) / 2 - float(full)) > 1e-4
