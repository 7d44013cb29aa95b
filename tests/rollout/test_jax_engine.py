"""`JaxEngine`: greedy parity (full forward, transformers), sampling maths, stops, seeds,
weight swap, bucketing, meshes, validation.

References: a greedy loop over the full forward (`Policy.logits` on the
growing, right-padded sequence), `transformers` `generate` on a tiny random
HF checkpoint, and numpy re-implementations of temperature / top-k / top-p.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agentrl import parallel
from agentrl.models import Policy, load_pretrained, model_config
from agentrl.models.lora import lora_spec
from agentrl.models.policy import NO_LORA, abstract_params, param_shardings
from agentrl.models.qwen import QwenModel
from agentrl.rollout.engine import Engine, SamplingParams
from agentrl.rollout.jax_engine import (
    JaxEngine,
    RowSampling,
    sample_tokens,
    top_k_mask,
    top_p_mask,
)
from tests.models.hf_reference import build_hf_model

top_k_mask_jit = jax.jit(top_k_mask)
top_p_mask_jit = jax.jit(top_p_mask)

VOCAB = 256
BUCKETS = (32, 64)  # prompt and cache lengths: 32 for most tests, 64 for long ones
REFERENCE_ROWS = 16
MAX_TOTAL = 64
PROMPT_LENGTHS = (5, 9, 1, 14, 3)


def make_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


def random_policy(config, seed, lora=NO_LORA):
    """A `Policy` with numpy-random parameters (no `Policy.init` compile: tests stay fast)."""
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(abstract_params(QwenModel(config, lora)))

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "scale" in name:
            return 1.0 + 0.1 * noise
        return (0.3 if "lora_b" in name else 0.02 if "kernel" in name or "embed" in name
                or "lm_head" in name else 0.1) * noise

    params = jax.device_put(jax.tree_util.tree_map_with_path(draw, shapes))
    return Policy(config, params, lora=lora)


@pytest.fixture(scope="module")
def policy():
    return random_policy(model_config("tiny", vocab_size=VOCAB, tie_word_embeddings=False), 0)


@pytest.fixture(scope="module")
def engine(policy):
    return make_engine(policy)


def make_engine(policy, **options):
    """Engines of one architecture share compiled functions; one batch shape keeps it at that."""
    options = dict(dict(max_batch_size=8, batch_buckets=(8,), length_buckets=BUCKETS,
                        max_total_length=MAX_TOTAL, seed=0, show_progress=False), **options)
    return JaxEngine(policy, **options)


def full_forward_logits(policy, sequences, width=MAX_TOTAL):
    """`[B, width, V]` logits of right-padded sequences (one compile for every call)."""
    assert len(sequences) <= REFERENCE_ROWS
    tokens = np.zeros((REFERENCE_ROWS, width), np.int32)
    mask = np.zeros_like(tokens)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq
        mask[row, :len(seq)] = 1
    return np.asarray(policy.logits(tokens, mask))[:len(sequences)]


def reference_greedy(policy, prompts, new_tokens):
    """Token-by-token greedy decoding with the full forward on the growing sequences."""
    sequences = [list(p) for p in prompts]
    for _ in range(new_tokens):
        logits = full_forward_logits(policy, sequences)
        for row, seq in enumerate(sequences):
            seq.append(int(np.argmax(logits[row, len(seq) - 1])))
    return [seq[len(p):] for seq, p in zip(sequences, prompts, strict=True)]


def numpy_sampling_distribution(logits, temperature, top_k, top_p):
    """Reference: softmax(logits / T) → keep top-k → renormalise → keep nucleus → renormalise."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    if top_k:
        kth = np.sort(probs)[::-1][top_k - 1]
        probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]  # mass strictly above each token
        keep = np.zeros_like(probs, bool)
        keep[order] = before < top_p
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


# ---------------------------------------------------------------------------
# Greedy parity.
# ---------------------------------------------------------------------------


def test_engine_implements_the_protocol(engine):
    assert isinstance(engine, Engine)


def test_greedy_equals_a_full_forward_greedy_loop(policy, engine):
    # Lengths 1…14 and budgets up to 13: prompt buckets 16, cache buckets 16 / 32.
    prompts = make_prompts(PROMPT_LENGTHS)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=13))
    expected = reference_greedy(policy, prompts, 13)
    assert [c.token_ids for c in out] == expected
    assert all(c.finish_reason == "length" and c.logprobs == [0.0] * 13 for c in out)
    assert len({tuple(c.token_ids) for c in out}) > 1  # the rows really differ


def test_greedy_with_lora_and_unscanned_layers_equals_the_full_forward():
    config = model_config("tiny", vocab_size=VOCAB, scan_layers=False)
    policy = random_policy(config, 1, lora=lora_spec(rank=2, alpha=4.0))  # lora_b ≠ 0
    assert "lora_b" in policy.params["layers_1"]["layer"]["mlp"]["up_proj"]
    engine = make_engine(policy, max_batch_size=4, batch_buckets=(4,), length_buckets=(16,),
                         max_total_length=32)
    prompts = make_prompts((6, 2, 11), seed=1)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [c.token_ids for c in out] == reference_greedy(policy, prompts, 8)


def test_greedy_equals_transformers_generate_on_a_hf_checkpoint(tmp_path):
    # Qwen3 (q/k RMSNorm, head_dim ≠ hidden / heads); the Qwen2 path is the tiny model's.
    hf_model = build_hf_model("qwen3", tie=False, seed=3)
    hf_model.save_pretrained(tmp_path)
    policy = load_pretrained(tmp_path)
    engine = make_engine(policy, max_batch_size=4, batch_buckets=(4,), length_buckets=(16,),
                         max_total_length=32)
    vocab = policy.config.vocab_size
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (4, 7, 11)]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    generation = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
        pad_token_id=0, bos_token_id=None)
    for prompt, completion in zip(prompts, out, strict=True):
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            ids = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=generation)
        assert completion.token_ids == ids[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------
# Log-probabilities and the sampling distribution.
# ---------------------------------------------------------------------------


def test_logprobs_equal_the_tempered_log_softmax_of_the_full_forward(policy, engine):
    prompts = make_prompts(PROMPT_LENGTHS, seed=4)
    out = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=10, seed=11))
    logits = full_forward_logits(policy, [p + c.token_ids for p, c in zip(prompts, out,
                                                                           strict=True)])
    checked = 0
    for row, (prompt, completion) in enumerate(zip(prompts, out, strict=True)):
        scaled = logits[row] / 0.7
        log_probs = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(
            -1, keepdims=True)) - scaled.max(-1, keepdims=True)
        for t, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                 strict=True)):
            assert logprob == pytest.approx(log_probs[len(prompt) - 1 + t, token], abs=2e-4)
            checked += 1
    assert checked == 50


def test_filtered_logprobs_equal_the_renormalised_distribution(policy, engine):
    # One batch, a different filter per row (top_k, top_p): per-row parameters are arrays.
    filters = [(5, 1.0), (0, 0.3), (20, 0.5), (0, 1.0), (1, 0.9)]
    prompts = make_prompts((4, 8, 12, 6, 3), seed=5)
    params = [SamplingParams(temperature=0.9, top_k=k, top_p=p, max_new_tokens=8, seed=100 + i)
              for i, (k, p) in enumerate(filters)]
    out = engine.generate(prompts, params)
    logits = full_forward_logits(policy, [p + c.token_ids for p, c in zip(prompts, out,
                                                                           strict=True)])
    for row, ((top_k, top_p), prompt, completion) in enumerate(zip(filters, prompts, out,
                                                                   strict=True)):
        kept_sizes = []
        for t, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                 strict=True)):
            probs = numpy_sampling_distribution(
                logits[row, len(prompt) - 1 + t].astype(np.float64), 0.9, top_k, top_p)
            assert probs[token] > 0  # inside the top-k / top-p set
            assert logprob == pytest.approx(np.log(probs[token]), abs=2e-4)
            kept_sizes.append(int((probs > 0).sum()))
        assert max(kept_sizes) <= (top_k or VOCAB)
        if top_k == 1:
            assert completion.logprobs == pytest.approx([0.0] * 8, abs=1e-6)
        elif top_k or top_p < 1:
            assert 1 < max(kept_sizes) < VOCAB  # the filter was active and not trivial
        else:
            assert min(kept_sizes) == VOCAB


def _sampling(batch, temperature, top_k=0, top_p=1.0, seed=0):
    return RowSampling(
        temperature=jnp.full((batch,), temperature, jnp.float32),
        top_k=jnp.full((batch,), top_k, jnp.int32),
        top_p=jnp.full((batch,), top_p, jnp.float32),
        seed_low=jnp.arange(batch, dtype=jnp.uint32) + jnp.uint32(seed),
        seed_high=jnp.zeros((batch,), jnp.uint32),
    )


sample_jit = jax.jit(sample_tokens)
# Chi-square critical values at p = 1e-4 by degrees of freedom (scipy.stats.chi2.isf(1e-4, df)).
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
def test_sampling_frequencies_match_the_distribution(top_k, top_p):
    row = np.array([1.5, 0.2, -0.3, 1.1, 0.0, -1.0, 0.7, 0.4], np.float32)
    draws = 40_000
    logits = jnp.tile(jnp.asarray(row), (draws, 1))
    tokens, logprobs = sample_jit(logits, _sampling(draws, 0.8, top_k, top_p, seed=7),
                                  jnp.zeros((draws,), jnp.int32))
    expected = numpy_sampling_distribution(row.astype(np.float64), 0.8, top_k, top_p)
    counts = np.bincount(np.asarray(tokens), minlength=row.size)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    assert kept.sum() >= 3
    chi2 = (((counts[kept] - draws * expected[kept]) ** 2) / (draws * expected[kept])).sum()
    assert chi2 < CHI2_CRITICAL[int(kept.sum()) - 1], (counts, draws * expected)
    np.testing.assert_allclose(np.asarray(logprobs), np.log(expected[np.asarray(tokens)]),
                               atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(-8, 8, width=32), min_size=16, max_size=16, unique=True),
       top_k=st.integers(0, 16), top_p=st.floats(0.05, 1.0))
@example(values=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 1.5, 1.25, 2.5, 3.5, 0.5,
                 3.303619199454118e-37, -1.0, -0.5],  # tied probabilities at the boundary
         top_k=0, top_p=0.9993589820616687)
def test_top_k_and_top_p_masks_match_numpy(values, top_k, top_p):
    logits = np.asarray(values, np.float32)
    k_mask = np.asarray(top_k_mask_jit(jnp.asarray(logits)[None], jnp.asarray([top_k])))[0]
    expected_k = (np.ones(16, bool) if top_k == 0
                  else logits >= np.sort(logits)[::-1][top_k - 1])
    np.testing.assert_array_equal(k_mask, expected_k)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    p_mask = np.asarray(top_p_mask_jit(jnp.asarray(probs)[None], jnp.asarray([top_p],
                                                                         np.float32)))[0]
    expected_p = numpy_sampling_distribution(logits.astype(np.float64), 1.0, 0, top_p) > 0
    # The boundary token may differ only when the mass above it is ambiguous: it ties
    # top_p in float32, or tokens of equal probability (e.g. logits 0 and 3e-37) sit at
    # the boundary and the two sorts order them differently.
    mismatch = np.flatnonzero(p_mask != expected_p)
    for index in mismatch:
        strictly_above = probs[probs > probs[index]].sum()
        above_with_ties = probs[probs >= probs[index]].sum() - probs[index]
        assert strictly_above - 1e-5 <= top_p <= above_with_ties + 1e-5, (index, top_p)
    assert p_mask[np.argmax(probs)]


def test_greedy_rows_have_zero_logprob_next_to_sampled_rows(engine):
    prompts = make_prompts((6, 6), seed=8)
    out = engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=5),
                                    SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)])
    alone = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert out[0].token_ids == alone[0].token_ids
    assert out[0].logprobs == [0.0] * 5
    assert all(lp < 0 for lp in out[1].logprobs)


# ---------------------------------------------------------------------------
# Stops, budgets, seeds.
# ---------------------------------------------------------------------------


def test_stop_token_ends_generation_and_is_included(engine):
    prompts = make_prompts((5, 9, 3), seed=9)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    stop = free[0].token_ids[3]
    first = free[0].token_ids.index(stop)
    params = [SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(VOCAB - 1,)),
              SamplingParams(temperature=0.0, max_new_tokens=10)]
    out = engine.generate(prompts, params)
    assert out[0].token_ids == free[0].token_ids[: first + 1]
    assert out[0].token_ids[-1] == stop and out[0].finish_reason == "stop"
    assert len(out[0].logprobs) == first + 1
    for row in (1, 2):
        if VOCAB - 1 not in free[row].token_ids:
            assert out[row].token_ids == free[row].token_ids
            assert out[row].finish_reason == "length"


def test_max_new_tokens_per_row_and_the_total_length_cap(engine):
    prompts = make_prompts((4, 4, 4, 60), seed=10)
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=n) for n in (1, 3, 7, 9)]
    out = engine.generate(prompts, params)
    assert [len(c.token_ids) for c in out] == [1, 3, 7, MAX_TOTAL - 60]
    assert [len(c.logprobs) for c in out] == [1, 3, 7, MAX_TOTAL - 60]
    assert all(c.finish_reason == "length" for c in out)


def test_seeded_rows_are_reproducible_across_batch_compositions(engine):
    prompt = make_prompts((7,), seed=11)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=1234)
    alone = engine.generate([prompt], seeded)[0]
    others = make_prompts((3, 13, 2), seed=12)
    mixed = engine.generate([others[0], others[1], prompt, others[2]],
                            [SamplingParams(temperature=1.0, max_new_tokens=15)] * 2 + [seeded]
                            + [SamplingParams(temperature=0.5, max_new_tokens=4, seed=9)])[2]
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_allclose(mixed.logprobs, alone.logprobs, atol=1e-5)
    again = engine.generate([prompt], seeded)[0]
    assert again.token_ids == alone.token_ids
    other_seed = engine.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9,
                                                          max_new_tokens=12, seed=1235))[0]
    assert other_seed.token_ids != alone.token_ids


def test_unseeded_rows_follow_the_engine_stream(policy):
    prompts = make_prompts((5, 5), seed=13)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)

    def run(seed):
        engine = make_engine(policy, seed=seed)
        return [c.token_ids for c in engine.generate(prompts, params)], engine

    first, engine = run(0)
    assert run(0)[0] == first  # same engine seed, same stream
    assert first[0] != first[1]  # same prompt twice: different draws
    assert [c.token_ids for c in engine.generate(prompts, params)] != first  # stream moves on


# ---------------------------------------------------------------------------
# Weight swap, bucketing, chunking, meshes.
# ---------------------------------------------------------------------------


def test_update_params_changes_outputs_without_recompiling(policy, engine):
    prompts = make_prompts((5, 9), seed=14)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [c.token_ids for c in engine.generate(prompts, greedy)]
    traces = engine.trace_counts
    sizes = (engine._prefill._cache_size(), engine._decode._cache_size())
    version = engine.policy_version
    rng = np.random.default_rng(7)
    other = jax.tree_util.tree_map(
        lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), policy.params)
    assert engine.update_params(other) == version + 1
    after = [c.token_ids for c in engine.generate(prompts, greedy)]
    assert after != before
    original, policy.params = policy.params, other
    try:
        assert after == reference_greedy(policy, prompts, 6)
    finally:
        policy.params = original
    engine.update_params(policy.params, version=41)
    assert engine.policy_version == 41
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == before
    assert engine.trace_counts == traces
    assert (engine._prefill._cache_size(), engine._decode._cache_size()) == sizes


def test_update_params_copies_so_a_donating_train_step_cannot_delete_them(policy, engine):
    prompts = make_prompts((5,), seed=22)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = engine.generate(prompts, greedy)
    trainer_params = jax.tree_util.tree_map(jnp.copy, engine.params)
    engine.update_params(trainer_params)
    for leaf in jax.tree_util.tree_leaves(trainer_params):
        leaf.delete()  # what donating the train state does to these buffers
    assert engine.generate(prompts, greedy) == expected
    placed = engine.params
    pointer = placed["lm_head"].unsafe_buffer_pointer()
    engine.update_params(placed, copy=False)  # already on the engine's shardings: shared
    assert engine.params["lm_head"].unsafe_buffer_pointer() == pointer
    engine.update_params(placed)  # the default copies
    assert engine.params["lm_head"].unsafe_buffer_pointer() != pointer


def test_update_params_rejects_a_different_tree(engine, policy):
    params = jax.tree_util.tree_map(lambda x: x, policy.params)
    params["lm_head"] = params["lm_head"][:, :-1]
    with pytest.raises(ValueError, match=r"\['lm_head'\].*cast or reshape"):
        engine.update_params(params)
    with pytest.raises(ValueError, match="update_params: the parameter tree has a different"):
        engine.update_params({"embed_tokens": policy.params["embed_tokens"]})


def test_prompts_in_the_same_bucket_do_not_recompile(policy):
    engine = make_engine(policy, length_buckets=(32, 48, 64))  # 48: used by no other test
    params = SamplingParams(temperature=0.8, top_k=3, max_new_tokens=4, seed=0)
    engine.generate(make_prompts((5,), seed=15), params)
    traces = engine.trace_counts
    engine.generate(make_prompts((9,), seed=16), params)
    engine.generate(make_prompts((9, 5, 2), seed=17),  # other rows, values, budgets: same shapes
                    SamplingParams(temperature=0.3, top_p=0.5, max_new_tokens=7, seed=3))
    assert engine.trace_counts == traces
    engine.generate(make_prompts((40,), seed=18), params)  # prompt and cache bucket 48
    after = engine.trace_counts
    assert (after["prefill"], after["decode"]) == (traces["prefill"] + 1, traces["decode"] + 1)


def test_requests_beyond_max_batch_size_are_split_in_order(policy, engine):
    assert engine.max_batch_size == 8
    prompts = make_prompts((3, 12, 5, 7, 1, 9, 4, 2, 6, 10, 8), seed=19)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    assert [c.token_ids for c in out] == reference_greedy(policy, prompts, 5)


def test_host_and_device_decode_loops_agree(policy, engine):
    host = make_engine(policy, decode_loop="host")
    prompts = make_prompts((5, 9, 3), seed=20)
    params = [SamplingParams(temperature=0.9, top_k=10, max_new_tokens=9, seed=s,
                             stop_token_ids=(7,)) for s in range(3)]
    expected = engine.generate(prompts, params)
    assert host.generate(prompts, params) == expected
    assert host.trace_counts["decode_step"] == 1


def test_sharded_mesh_matches_one_device(policy, engine):
    # Rows over data × fsdp = 8 devices, parameters' embedding axis over fsdp = 4.
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=4, tensor=1))
    shardings, _ = param_shardings(policy.model, mesh, policy.rules)
    sharded = Policy(policy.config, jax.device_put(policy.params, shardings), mesh, policy.rules)
    sharded_engine = make_engine(sharded)
    assert sharded_engine.batch_shards == 8
    prompts = make_prompts((5, 9, 3, 12), seed=21)
    params = [SamplingParams(temperature=0.0, max_new_tokens=7),
              SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=7, seed=1),
              SamplingParams(temperature=1.0, top_k=5, max_new_tokens=7, seed=2),
              SamplingParams(temperature=0.0, max_new_tokens=3)]
    expected = engine.generate(prompts, params)
    out = sharded_engine.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    sharding = sharded_engine.last_batch_sharding  # the batch axis is split over 8 devices
    assert sharding.shard_shape((8, 16))[0] == 1


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompts,message", [
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 2], [3] * MAX_TOTAL], f"prompt 1 has {MAX_TOTAL} tokens.*max_total_length"),
    ([[1, VOCAB, 2]], f"prompt 0 has token id {VOCAB} at position 1.*vocabulary"),
    ([[4], [1, -1]], "prompt 1 has token id -1 at position 1"),
])
def test_bad_prompts_are_named(engine, prompts, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_bad_stop_ids_and_param_counts_are_named(engine):
    with pytest.raises(ValueError, match="SamplingParams 1 has stop_token_ids"):
        engine.generate([[1], [2]], [SamplingParams(), SamplingParams(stop_token_ids=(VOCAB,))])
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate([[1], [2]], [SamplingParams()])
    assert engine.generate([], SamplingParams()) == []
