"""Meshes, logical rules, and sharded forward/backward equal to one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from agentrl import parallel
from agentrl.models.config import model_config
from agentrl.models.policy import Policy
from agentrl.models.qwen import QwenModel

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2), (4, 1, 2)]


def test_mesh_config_shapes_and_errors():
    assert parallel.MeshConfig().shape(8) == (8, 1, 1)
    assert parallel.MeshConfig(data=-1, fsdp=2, tensor=2).shape(8) == (2, 2, 2)
    with pytest.raises(ValueError, match="needs 9 devices"):
        parallel.MeshConfig(data=3, fsdp=3, tensor=1).shape(8)
    assert len(parallel.make_mesh(parallel.MeshConfig(data=1, fsdp=2)).devices.flat) == 2
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        parallel.MeshConfig(data=-1, fsdp=-1).shape(8)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_fit_spec_drops_axes_that_do_not_divide():
    mesh_shape = {"data": 2, "fsdp": 4, "tensor": 2}
    assert parallel.fit_spec(PartitionSpec("fsdp", "tensor"), (8, 6), mesh_shape) == \
        PartitionSpec("fsdp", "tensor")
    assert parallel.fit_spec(PartitionSpec("fsdp", "tensor"), (6, 3), mesh_shape) == \
        PartitionSpec(None, None)
    assert parallel.fit_spec(PartitionSpec(("data", "fsdp")), (4,), mesh_shape) == \
        PartitionSpec("data")
    assert parallel.fit_spec(PartitionSpec(("data", "fsdp")), (16,), mesh_shape) == \
        PartitionSpec(("data", "fsdp"))


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(8, 12))
    mask = (np.arange(12)[None, :] < rng.integers(4, 13, size=8)[:, None]).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(mask)


def _loss_and_grads(policy, tokens, mask):
    model = policy.model

    def loss(params):
        hidden = model.apply({"params": params}, tokens, segment_ids=mask)["hidden"]
        logits = model.apply({"params": params}, hidden, method=QwenModel.logits)
        log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
        weights = mask[:, 1:].astype(jnp.float32)
        return -(picked * weights).sum() / weights.sum(), logits

    with jax.set_mesh(policy.mesh), nn.logical_axis_rules(policy.rules):
        batch_sharding = parallel.logical_sharding(("batch", "length"), tokens.shape, policy.mesh,
                                                   policy.rules)
        tokens = jax.device_put(tokens, batch_sharding)
        mask = jax.device_put(mask, batch_sharding)
        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(policy.params)
    return value, logits, grads


@pytest.fixture(scope="module")
def single_device_reference():
    config = model_config("tiny", vocab_size=300, num_attention_heads=4, num_key_value_heads=2)
    policy = Policy.init(config, 0)
    return config, _loss_and_grads(policy, *_batch())


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_forward_and_gradients_equal_single_device(shape, single_device_reference):
    config, (value, logits, grads) = single_device_reference
    mesh = parallel.make_mesh(parallel.MeshConfig(*shape))
    policy = Policy.init(config, 0, mesh=mesh)
    kernel = policy.params["layers"]["layer"]["mlp"]["gate_proj"]["kernel"]
    assert len(kernel.sharding.device_set) == 8
    expected_spec = parallel.fit_spec(PartitionSpec(None, "fsdp", "tensor"), kernel.shape,
                                      dict(mesh.shape))
    assert kernel.sharding.spec == expected_spec
    sharded_value, sharded_logits, sharded_grads = _loss_and_grads(policy, *_batch())
    np.testing.assert_allclose(sharded_value, value, atol=1e-5)
    np.testing.assert_allclose(sharded_logits, logits, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(sharded_grads), jax.tree_util.tree_leaves(grads),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_params_are_created_sharded_not_gathered():
    mesh = parallel.make_mesh(parallel.MeshConfig(data=1, fsdp=8, tensor=1))
    config = model_config("tiny", vocab_size=304)
    policy = Policy.init(config, 0, mesh=mesh)
    embed = policy.params["embed_tokens"]
    assert embed.sharding.spec[1] == "fsdp"
    assert {shard.data.shape for shard in embed.addressable_shards} == {(304, 8)}
