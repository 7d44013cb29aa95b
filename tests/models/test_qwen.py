"""Flax Qwen2/Qwen3 against transformers (PyTorch, CPU, fp32), and its own invariants."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl.models.config import QwenConfig, model_config, param_count
from agentrl.models.policy import Policy, load_pretrained
from agentrl.models.qwen import QwenModel, init_cache, token_logprobs_and_entropy
from agentrl.models.weights import unstack_layers
from tests.models.hf_reference import VARIANTS, VOCAB, build_hf_model, hf_forward

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def reference(request, tmp_path_factory):
    family, tie = VARIANTS[request.param]
    model = build_hf_model(family, tie)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory, load_pretrained(directory)


def _padded_batch(seed=0, batch=3, length=13):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(batch, length))
    lengths = np.array([length, 8, 5][:batch])
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    return tokens, mask


def test_config_from_hf_matches_the_checkpoint(reference):
    model, _, policy = reference
    hf = model.config
    config = policy.config
    assert config.model_type == hf.model_type
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.head_dim == (24 if hf.model_type == "qwen3" else 16)
    assert config.qk_norm == (hf.model_type == "qwen3")
    assert config.attention_bias == (hf.model_type == "qwen2")
    assert param_count(config) == sum(p.numel() for p in model.parameters())


def test_logits_and_every_layer_match_transformers_on_a_padded_batch(reference):
    model, _, policy = reference
    tokens, mask = _padded_batch()
    hf_logits, hf_hidden = hf_forward(model, tokens, mask)
    valid = mask.astype(bool)
    logits = np.asarray(policy.logits(tokens, mask))
    assert np.abs(logits - hf_logits)[valid].max() <= TOLERANCE
    out = policy.model.apply({"params": policy.params}, jnp.asarray(tokens),
                             segment_ids=jnp.asarray(mask), return_hidden=True)
    layers = policy.config.num_hidden_layers
    # hidden_states = (embeddings, layer 1 ... layer L-1 outputs, final normed output).
    for i in range(layers - 1):
        diff = np.abs(np.asarray(out["layer_hidden"][i]) - hf_hidden[i + 1])[valid].max()
        assert diff <= TOLERANCE, f"layer {i}: {diff}"
    assert np.abs(np.asarray(out["hidden"]) - hf_hidden[layers])[valid].max() <= TOLERANCE


def test_left_padding_with_explicit_positions_matches_transformers(reference):
    model, _, policy = reference
    tokens, right_mask = _padded_batch(seed=1)
    mask = right_mask[:, ::-1].copy()  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    hf_logits, _ = hf_forward(model, tokens, mask, positions)
    logits = np.asarray(policy.logits(tokens, mask, positions))
    assert np.abs(logits - hf_logits)[mask.astype(bool)].max() <= TOLERANCE


def test_packed_rows_equal_separate_rows(reference):
    _, _, policy = reference
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, VOCAB, size=7), rng.integers(0, VOCAB, size=5)
    packed = np.concatenate([first, second, [0, 0]])[None]
    segments = np.array([[1] * 7 + [2] * 5 + [0, 0]])
    packed_logits = np.asarray(policy.logits(packed, segments))
    alone_first = np.asarray(policy.logits(first[None]))
    alone_second = np.asarray(policy.logits(second[None]))
    assert np.abs(packed_logits[0, :7] - alone_first[0]).max() <= TOLERANCE
    assert np.abs(packed_logits[0, 7:12] - alone_second[0]).max() <= TOLERANCE


def test_kv_cache_decode_equals_full_forward_token_by_token(reference):
    _, _, policy = reference
    model, params, config = policy.model, policy.params, policy.config
    tokens, mask = _padded_batch(seed=3, length=12)
    lengths = mask.sum(axis=1)
    full = np.asarray(policy.logits(tokens, mask))
    prompt = np.array([4, 3, 2])
    cache = init_cache(config, tokens.shape[0], 16)

    @jax.jit
    def step(cache, chunk, valid):
        out = model.apply({"params": params}, chunk, segment_ids=valid, cache=cache)
        logits = model.apply({"params": params}, out["hidden"], method=QwenModel.logits)
        return logits, out["cache"]

    prompt_mask = (np.arange(4)[None, :] < prompt[:, None]).astype(np.int32)
    logits, cache = step(cache, tokens[:, :4], prompt_mask)
    checked = 0
    for b in range(3):
        assert np.abs(np.asarray(logits[b, : prompt[b]]) - full[b, : prompt[b]]).max() <= TOLERANCE
    for offset in range(10):
        index = prompt + offset
        chunk = tokens[np.arange(3), np.minimum(index, 11)][:, None]
        valid = (index < lengths)[:, None].astype(np.int32)
        logits, cache = step(cache, chunk, valid)
        for b in np.flatnonzero(valid[:, 0]):
            assert np.abs(np.asarray(logits[b, 0]) - full[b, index[b]]).max() <= TOLERANCE
            checked += 1
    assert checked == int((lengths - prompt).sum())
    np.testing.assert_array_equal(np.asarray(cache.index), lengths)


def test_chunked_logprobs_and_gradients_equal_the_full_logits_path():
    config = model_config("tiny", vocab_size=VOCAB, logits_chunk_size=4)
    policy = Policy.init(config, 0)
    tokens, mask = _padded_batch(seed=4, length=11)
    model = policy.model

    def chunked(params):
        hidden = model.apply({"params": params}, tokens, segment_ids=mask)["hidden"]
        unembed = model.apply({"params": params}, method=QwenModel.unembedding)
        logp, entropy = token_logprobs_and_entropy(hidden[:, :-1], tokens[:, 1:], unembed,
                                                   chunk_size=4)
        return logp, entropy

    def full(params):
        hidden = model.apply({"params": params}, tokens, segment_ids=mask)["hidden"]
        log_probs = jax.nn.log_softmax(
            model.apply({"params": params}, hidden, method=QwenModel.logits)[:, :-1], axis=-1)
        logp = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
        return logp, -(jnp.exp(log_probs) * log_probs).sum(-1)

    (logp_c, ent_c), (logp_f, ent_f) = jax.jit(chunked)(policy.params), jax.jit(full)(policy.params)
    np.testing.assert_allclose(logp_c, logp_f, atol=1e-5)
    np.testing.assert_allclose(ent_c, ent_f, atol=1e-5)
    weights = jnp.asarray(mask[:, 1:], jnp.float32)

    def loss(fn, params):
        logp, entropy = fn(params)
        return -(weights * logp).sum() + 0.01 * (weights * entropy).sum()

    grad_c = jax.jit(jax.grad(functools.partial(loss, chunked)))(policy.params)
    grad_f = jax.jit(jax.grad(functools.partial(loss, full)))(policy.params)
    for a, b in zip(jax.tree_util.tree_leaves(grad_c), jax.tree_util.tree_leaves(grad_f),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_and_unscanned_layers_change_nothing(remat):
    config = model_config("tiny", vocab_size=VOCAB)
    policy = Policy.init(config, 1)
    tokens, mask = _padded_batch(seed=5)

    def loss_and_grad(model, params):
        def loss(p):
            hidden = model.apply({"params": p}, tokens, segment_ids=mask)["hidden"]
            return jnp.mean(model.apply({"params": p}, hidden, method=QwenModel.logits) ** 2)
        return jax.jit(jax.value_and_grad(loss))(params)

    base_loss, base_grad = loss_and_grad(policy.model, policy.params)
    remat_loss, remat_grad = loss_and_grad(QwenModel(config.replace(remat=remat)), policy.params)
    unscanned = QwenModel(config.replace(scan_layers=False, remat=remat))
    flat_params = unstack_layers(policy.params, config.num_hidden_layers)
    flat_loss, flat_grad = loss_and_grad(unscanned, flat_params)
    np.testing.assert_allclose(remat_loss, base_loss, rtol=1e-6)
    np.testing.assert_allclose(flat_loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(remat_grad), jax.tree_util.tree_leaves(base_grad),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    restacked = unstack_layers(base_grad, config.num_hidden_layers)
    for a, b in zip(jax.tree_util.tree_leaves(flat_grad), jax.tree_util.tree_leaves(restacked),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bfloat16_compute_stays_close_to_float32(reference):
    _, directory, policy = reference
    tokens, mask = _padded_batch(seed=6)
    bf16 = load_pretrained(directory, dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(bf16.params)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    diff = np.abs(np.asarray(bf16.logits(tokens, mask)) - np.asarray(policy.logits(tokens, mask)))
    assert diff[mask.astype(bool)].max() < 5e-2


def test_config_round_trip_and_presets():
    config = model_config("qwen3_8b")
    assert QwenConfig.from_hf(config.to_hf()) == config
    assert param_count(model_config("qwen2_5_7b")) == 7_615_616_512
    abstract = jax.eval_shape(
        lambda k: QwenModel(model_config("qwen2_5_0_5b")).init(k, jnp.zeros((1, 1), jnp.int32)),
        jax.random.key(0))
    count = sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(abstract)))
    assert count == param_count(model_config("qwen2_5_0_5b")) == 494_032_768
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model_config("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="model_type='llama'"):
        QwenConfig.from_hf({**config.to_hf(), "model_type": "llama"})
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(NotImplementedError, match="YaRN"):
        QwenConfig.from_hf({**config.to_hf(), "rope_scaling": yarn})
    with pytest.raises(NotImplementedError, match="YaRN"):  # transformers >= 5 spelling
        QwenConfig.from_hf({**config.to_hf(), "rope_parameters": yarn})
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        QwenConfig.from_hf({**config.to_hf(), "use_sliding_window": True})
    default = {"rope_type": "default", "rope_theta": 5e5}
    assert QwenConfig.from_hf({**config.to_hf(), "rope_parameters": default}).rope_theta == 1e6
