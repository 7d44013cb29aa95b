"""Value heads (PPO linear, CARL MLP) on shared and separate backbones."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl.models.config import model_config
from agentrl.models.heads import CarlValueHead, LinearValueHead, PolicyValueModel, ValueModel

CONFIG = model_config("tiny", vocab_size=300)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 300, size=(2, 9)))


def test_carl_head_starts_at_one_half_with_zero_final_layer():
    head = CarlValueHead()
    hidden = jax.random.normal(jax.random.key(0), (2, 5, 16))
    params = head.init(jax.random.key(1), hidden)["params"]
    np.testing.assert_array_equal(nn.meta.unbox(params)["output_kernel"], 0.0)
    values = head.apply({"params": params}, hidden)
    assert values.shape == (2, 5)
    np.testing.assert_allclose(values, 0.5)
    # The final layer is zero, so only it gets a gradient at init; values move once it does.
    grads = jax.grad(lambda p: head.apply({"params": p}, hidden).sum())(params)
    grads = nn.meta.unbox(grads)
    assert np.abs(grads["output_kernel"]).sum() > 0
    np.testing.assert_array_equal(grads["hidden_kernel"], 0.0)


def test_carl_head_matches_its_formula():
    head = CarlValueHead()
    hidden = jax.random.normal(jax.random.key(2), (3, 8))
    params = nn.meta.unbox(head.init(jax.random.key(3), hidden)["params"])
    params["output_kernel"] = jax.random.normal(jax.random.key(4), (8, 1))
    params["output_bias"] = jnp.array([0.3])
    expected = jax.nn.sigmoid(
        jax.nn.gelu(hidden @ params["hidden_kernel"] + params["hidden_bias"][None, :])
        @ params["output_kernel"][:, 0] + 0.3)
    np.testing.assert_allclose(head.apply({"params": params}, hidden), expected, atol=1e-6)


def test_linear_head_is_affine():
    head = LinearValueHead()
    hidden = jax.random.normal(jax.random.key(5), (2, 4, 16))
    params = nn.meta.unbox(head.init(jax.random.key(6), hidden)["params"])
    values = head.apply({"params": params}, hidden)
    np.testing.assert_allclose(values, hidden @ params["kernel"][:, 0] + params["bias"][0],
                               atol=1e-6)


@pytest.mark.parametrize("head", ["linear", "carl"])
def test_shared_backbone_gets_value_gradients(head):
    model = PolicyValueModel(CONFIG, head=head)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), TOKENS)["params"])
    assert set(params) == {"backbone", "value_head"}
    out = jax.jit(model.apply)({"params": params}, TOKENS)
    assert out["values"].shape == TOKENS.shape and out["hidden"].shape == (2, 9, 64)
    if head == "carl":  # make the head sensitive to its input first
        params["value_head"]["output_kernel"] = jnp.ones_like(
            params["value_head"]["output_kernel"])
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, TOKENS)["values"].sum()))(params)
    embed_grad = grads["backbone"]["embed_tokens"]
    assert np.abs(np.asarray(embed_grad)).sum() > 0
    logits = model.apply({"params": params}, out["hidden"], method=PolicyValueModel.logits)
    assert logits.shape == (2, 9, 300)


def test_separate_critic_has_its_own_backbone():
    critic = ValueModel(CONFIG, head="linear")
    params = nn.meta.unbox(jax.jit(critic.init)(jax.random.key(1), TOKENS)["params"])
    assert set(params) == {"backbone", "value_head"}
    assert jax.jit(critic.apply)({"params": params}, TOKENS).shape == TOKENS.shape
    with pytest.raises(ValueError, match="kind='mlp'"):
        ValueModel(CONFIG, head="mlp").init(jax.random.key(1), TOKENS)
