"""`JaxEngine`: in-process batched generation with a jitted prefill and KV-cache decode.

    engine = JaxEngine(policy, max_batch_size=64)
    completions = engine.generate(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=512,
                                                             stop_token_ids=tok.stop_token_ids))
    engine.update_params(new_params)          # after a train step: in place, no recompilation

One `generate` call is split into chunks of at most `max_batch_size` prompts
(sorted by length so similar prompts share a chunk). Each chunk runs two
jitted functions:

* `prefill`: the right-padded prompts `[B, P]` go through the policy's
  `QwenModel` with a fresh `KVCache` of `S` slots (the model's `cache=`
  path); the result is the cache (re-laid out per layer, `LayerCaches`) and
  each row's next-token logits at its last prompt position.
* `decode`: a `lax.while_loop` inside one jit; each iteration samples every
  unfinished row's next token, records it, and feeds it through
  `decode_logits` (one token per row; finished rows are masked: they write
  nothing and keep their cache index), until every row has stopped. A Python
  loop over the same jitted step (`decode_loop="host"`) gives the same
  tokens and is slower on CPU (`docs/rollouts.md`).

Shapes are bucketed so a new request rarely compiles: the batch is padded to
a batch bucket (default: powers of two from the mesh's data-parallel size),
the prompt to the smallest length bucket `P ≥` the longest prompt, the cache
to the smallest bucket `S ≥` the longest prompt + its token budget. Sampling
parameters, budgets, seeds and stop ids are arrays, so their values never
recompile; engines of one architecture share their compiled functions.

Sampling (`sample_tokens`): temperature, then top-k, then top-p (nucleus)
on the renormalised top-k distribution (the order of transformers and vLLM),
then one draw per row by inverse CDF from a key that depends only on the
row's seed and its step; temperature 0 is greedy (argmax, log-probability
0). The returned log-probability is that of the sampled token under this
final, renormalised distribution. The top-k and top-p thresholds are found
by bisection on the float bit patterns (32 passes over the vocabulary,
exact) because XLA's CPU sort of `[B, V]` is 20-40× slower; ties at the
threshold are all kept.
"""

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import chex
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from agentrl.models.policy import param_shardings
from agentrl.models.qwen import (
    MLP,
    KVCache,
    Projection,
    QwenModel,
    RMSNorm,
    apply_rope,
    dtype_of,
    init_cache,
    rope_tables,
)
from agentrl.parallel import constrain
from agentrl.rollout.engine import Completion, SamplingParams, per_prompt_params

Array = chex.Array

DEFAULT_LENGTH_BUCKETS = tuple(2**i for i in range(6, 16))  # 64 … 32768
CDF_BLOCK = 128
STOP_IDS_MIN = 4
UINT32_MAX = 0xFFFFFFFF


# ---------------------------------------------------------------------------
# Sampling: pure functions on `[B, V]` logits with per-row parameters.
# ---------------------------------------------------------------------------


def sortable_bits(x: Array) -> Array:
    """float32 → uint32 with the same order (`a < b` ⇔ `bits(a) < bits(b)`; -0 < +0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def largest_threshold(keys: Array, holds) -> Array:
    """Per row, the largest `τ` (uint32) with `holds(keys >= τ)` true, by 32 bisection steps.

    `holds(mask [B, V]) -> [B] bool` must be monotone (true for a mask, true
    for every superset) and true for the all-true mask (`τ = 0`).

    Args:
      keys: `[B, V]` uint32 (`sortable_bits` of the values).
      holds: the predicate.

    Returns:
      `[B]` uint32; the kept set is `keys >= τ`.
    """
    rows = keys.shape[0]

    def step(_, bounds):
        low, high = bounds
        gap = high - low
        middle = low + gap // 2 + (gap & 1)  # ceil((low + high) / 2) without overflow
        ok = holds(keys >= middle[:, None])
        return jnp.where(ok, middle, low), jnp.where(ok, high, middle - 1)

    low = jnp.zeros((rows,), jnp.uint32)
    high = jnp.full((rows,), UINT32_MAX, jnp.uint32)
    low, _ = jax.lax.fori_loop(0, 32, step, (low, high))
    return low


def top_k_mask(logits: Array, top_k: Array) -> Array:
    """`[B, V]` bool: the `top_k[b]` largest logits of each row (ties at the boundary kept).

    Args:
      logits: `[B, V]` float.
      top_k: `[B]` int; 0 (or ≥ V) keeps every token.
    """
    vocab = logits.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    keys = sortable_bits(logits)
    tau = largest_threshold(keys, lambda kept: jnp.sum(kept, axis=-1) >= k)
    return keys >= tau[:, None]


def top_p_mask(probs: Array, top_p: Array) -> Array:
    """`[B, V]` bool: the nucleus — the most likely tokens whose mass first reaches `top_p`.

    Kept: tokens with `p ≥ τ`, `τ` the largest value with `Σ_{p ≥ τ} p ≥ top_p · Σ p`
    (Holtzman et al. 2020, §3.1; ties at the boundary all kept).

    Args:
      probs: `[B, V]` non-negative (need not sum to 1: masked rows are fine).
      top_p: `[B]` in (0, 1]; 1 keeps every token.
    """
    total = jnp.sum(probs, axis=-1)
    keys = sortable_bits(probs)

    def holds(kept):
        return jnp.sum(jnp.where(kept, probs, 0.0), axis=-1) >= top_p * total

    tau = largest_threshold(keys, holds)
    return (keys >= tau[:, None]) | (top_p >= 1.0)[:, None]


def filtered_log_probs(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """`[B, V]` log-probabilities of the sampling distribution (−inf outside the kept set).

    `log softmax(mask(logits / T))` with the mask of top-k, then of top-p on
    the renormalised top-k distribution. Rows with `T = 0` use `T = 1` here
    (they are decoded greedily). The filtering passes run only when some row
    asks for them (`lax.cond`), so unfiltered sampling costs one softmax.

    Args:
      logits: `[B, V]` float32.
      temperature: `[B]` ≥ 0.
      top_k: `[B]` int (0: off).
      top_p: `[B]` in (0, 1] (1: off).
    """
    chex.assert_rank(logits, 2)
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_temperature[:, None]

    def filtered(scaled):
        vocab = scaled.shape[-1]
        kept = top_k_mask(scaled, top_k) | ((top_k <= 0) | (top_k >= vocab))[:, None]
        scaled = jnp.where(kept, scaled, -jnp.inf)
        probs = jax.nn.softmax(scaled, axis=-1)
        return jnp.where(top_p_mask(probs, top_p), scaled, -jnp.inf)

    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, filtered, lambda s: s, scaled)
    return jax.nn.log_softmax(scaled, axis=-1)


def inverse_cdf_sample(probs: Array, uniform: Array) -> Array:
    """One index per row with `P(i) = probs[i] / Σ probs`, from one uniform number per row.

    The CDF is built in two levels (block sums, then a cumulative sum inside
    the chosen block of `CDF_BLOCK` tokens): O(V) work instead of a
    full-length scan. The result always has `probs > 0`.

    Args:
      probs: `[B, V]` non-negative, every row with positive mass.
      uniform: `[B]` in (0, 1].

    Returns:
      `[B]` int32.
    """
    rows, vocab = probs.shape
    blocks = -(-vocab // CDF_BLOCK)
    padded = jnp.pad(probs, ((0, 0), (0, blocks * CDF_BLOCK - vocab)))
    padded = padded.reshape(rows, blocks, CDF_BLOCK)
    block_cdf = jnp.cumsum(jnp.sum(padded, axis=-1), axis=-1)  # [B, blocks]
    target = uniform * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), blocks - 1)
    before = jnp.where(block > 0, jnp.take_along_axis(
        block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inside = jnp.take_along_axis(padded, block[:, None, None], axis=1)[:, 0]  # [B, CDF_BLOCK]
    cdf = before[:, None] + jnp.cumsum(inside, axis=-1)
    offset = jnp.sum(cdf < target[:, None], axis=-1)
    # Rounding can point at a zero-probability slot: take the nearest positive one.
    lanes = jnp.arange(CDF_BLOCK)[None, :]
    positive = inside > 0
    after = jnp.min(jnp.where(positive & (lanes >= offset[:, None]), lanes, CDF_BLOCK), axis=-1)
    last = jnp.max(jnp.where(positive, lanes, -1), axis=-1)
    offset = jnp.where(after < CDF_BLOCK, after, last)
    return (block * CDF_BLOCK + offset).astype(jnp.int32)


def row_keys(seed_low: Array, seed_high: Array, step: Array) -> Array:
    """`[B]` PRNG keys: `fold_in(fold_in(key(seed_low), seed_high), step)` per row.

    A row's randomness depends only on its own 64-bit seed and its own step
    index, never on the other rows of the batch.
    """
    def one(low, high, index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(low), high), index)

    return jax.vmap(one)(seed_low, seed_high, step)


def greedy_tokens(logits: Array) -> Array:
    """`[B]` int32: the first index of each row's maximum (`jnp.argmax`, 3× faster on XLA CPU)."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    lanes = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.minimum(jnp.min(jnp.where(logits == top, lanes, vocab), axis=-1), vocab - 1)


def sample_tokens(logits: Array, sampling: "RowSampling", step: Array) -> tuple[Array, Array]:
    """Samples one token per row and its log-probability under the sampling distribution.

    Args:
      logits: `[B, V]` float32 next-token logits.
      sampling: per-row parameters (`[B]` arrays).
      step: `[B]` int, the index of this token in the row's completion (the
        PRNG stream position).

    Returns:
      `(tokens [B] int32, logprobs [B] float32)`; greedy rows (`T = 0`):
      argmax and 0. An all-greedy batch skips the sampling work (`lax.cond`).
    """
    chex.assert_rank(logits, 2)
    greedy = sampling.temperature <= 0
    argmax = greedy_tokens(logits)

    def sampled():
        log_probs = filtered_log_probs(logits, sampling.temperature, sampling.top_k,
                                       sampling.top_p)
        keys = row_keys(sampling.seed_low, sampling.seed_high, step)
        uniform = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]
        drawn = inverse_cdf_sample(jnp.exp(log_probs), uniform)
        picked = jnp.take_along_axis(log_probs, drawn[:, None], axis=-1)[:, 0]
        return jnp.where(greedy, argmax, drawn), jnp.where(greedy, 0.0, picked)

    return jax.lax.cond(jnp.all(greedy), lambda: (argmax, jnp.zeros(argmax.shape, jnp.float32)),
                        sampled)


# ---------------------------------------------------------------------------
# The decode-time forward pass: per-layer, head-major KV caches.
# ---------------------------------------------------------------------------


@flax.struct.dataclass
class LayerCaches:
    """The decode loop's KV cache: one buffer per layer, `[B, kv_heads, S, head_dim]`.

    `QwenModel`'s `KVCache` stacks the layers (`[L, B, S, kv_heads, head_dim]`)
    and threads them through `nn.scan`, so every decode step slices and
    re-stacks the whole cache, and attention transposes each layer's slice
    (measured on CPU, 51 M model, batch 16: 18 ms/step at S = 256, 80 ms at
    S = 1024). Here each layer's cache is its own while-loop carry buffer,
    updated in place by a one-slot scatter and read by attention without a
    copy (8 ms and 16 ms). The prefill still runs the model's `cache=` path
    and converts its cache once (`from_kv_cache`).

    Attributes:
      keys, values: `L`-tuples of `[B, kv_heads, S, head_dim]` (RoPE applied to keys).
      valid: `[B, S]` bool, slots holding a real token.
      index: `[B]` int32, the next slot of each row.
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    valid: Array
    index: Array

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def from_kv_cache(cls, cache: KVCache) -> "LayerCaches":
        """Splits and transposes a model `KVCache` (`[L, B, S, K, H]` → L × `[B, K, S, H]`)."""
        keys = cache.key.transpose(0, 1, 3, 2, 4)
        values = cache.value.transpose(0, 1, 3, 2, 4)
        layers = range(keys.shape[0])
        return cls(keys=tuple(keys[i] for i in layers), values=tuple(values[i] for i in layers),
                   valid=cache.valid, index=cache.index)


def layer_params(params: Any, config) -> list[Any]:
    """The per-layer parameter trees of a `QwenModel` (scanned or unscanned layout)."""
    if config.scan_layers:
        stacked = params["layers"]["layer"]
        return [jax.tree_util.tree_map(lambda w, i=i: w[i], stacked)
                for i in range(config.num_hidden_layers)]
    return [params[f"layers_{i}"]["layer"] for i in range(config.num_hidden_layers)]


def cached_attention(query: Array, keys: Array, values: Array, mask: Array) -> Array:
    """One query per row against its cached keys / values (grouped-query attention).

    Same numerics as `jax.nn.dot_product_attention` (XLA path): float32
    scores scaled by `1/√H`, masked to the dtype's minimum, float32 softmax.

    Args:
      query: `[B, 1, N, H]` (N query heads).
      keys, values: `[B, K, S, H]` (K key-value heads, N = K·G).
      mask: `[B, S]` bool, slots to attend to.

    Returns:
      `[B, 1, N, H]`.
    """
    batch, _, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query[:, 0].reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bkgh,bksh->bkgs", grouped, keys, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / np.sqrt(head_dim))
    scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, values)
    return out.reshape(batch, 1, heads, head_dim)


def decoder_layer_step(model: QwenModel, params: Any, x: Array, cos: Array, sin: Array,
                       mask: Array, slot: Array, keys: Array, values: Array):
    """One decoder layer for one new token per row, writing its key / value at `slot`.

    Mirrors `qwen.DecoderLayer` / `qwen.Attention` with the model's own
    modules (`Projection` (LoRA included), `RMSNorm`, `MLP`, `apply_rope`).

    Args:
      model: the `QwenModel` (config and LoRA spec).
      params: this layer's parameters (the `DecoderLayer` tree).
      x: `[B, 1, D]` hidden states.
      cos, sin: `[B, 1, head_dim]` RoPE tables at each row's position.
      mask: `[B, S]` bool, the slots to attend to (the new one included).
      slot: `[B]` int32, where each row writes (`S`: nowhere).
      keys, values: this layer's `[B, K, S, H]` caches.

    Returns:
      `(x [B, 1, D], keys, values)`.
    """
    cfg, lora = model.config, model.lora
    dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    d, h, hd, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    attn = params["self_attn"]

    def project(name, in_shape, out_shape, in_axes, out_axes, bias, inputs, tree=attn):
        module = Projection(in_shape, out_shape, in_axes, out_axes, bias, dtype, param_dtype, lora,
                            name=name)
        return module.apply({"params": tree[name]}, inputs)

    def norm(tree, axis_name, inputs):
        return RMSNorm(cfg.rms_norm_eps, axis_name, dtype, param_dtype).apply(
            {"params": tree}, inputs)

    normed = norm(params["input_layernorm"], "embed", x)
    q = project("q_proj", (d,), (h, hd), ("embed",), ("heads", "head_dim"), cfg.attention_bias,
                normed)
    k = project("k_proj", (d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"),
                cfg.attention_bias, normed)
    v = project("v_proj", (d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"),
                cfg.attention_bias, normed)
    if cfg.qk_norm:
        q = norm(attn["q_norm"], "head_dim", q)
        k = norm(attn["k_norm"], "head_dim", k)
    q = constrain(apply_rope(q, cos, sin), ("batch", "length", "act_heads", None))
    k = apply_rope(k, cos, sin)
    rows = jnp.arange(x.shape[0])
    keys = keys.at[rows, :, slot].set(k[:, 0].astype(keys.dtype), mode="drop")
    values = values.at[rows, :, slot].set(v[:, 0].astype(values.dtype), mode="drop")
    out = cached_attention(q, keys.astype(dtype), values.astype(dtype), mask)
    out = project("o_proj", (h, hd), (d,), ("heads", "head_dim"), ("embed",), False, out)
    x = constrain(x + out, ("batch", "length", "act_embed"))
    mlp = MLP(cfg, lora).apply({"params": params["mlp"]},
                               norm(params["post_attention_layernorm"], "embed", x))
    return constrain(x + mlp, ("batch", "length", "act_embed")), keys, values


def decode_logits(model: QwenModel, params: Any, tokens: Array, active: Array,
                  caches: LayerCaches) -> tuple[Array, LayerCaches]:
    """Next-token logits for one new token per row; inactive rows write nothing.

    Equals `QwenModel` with `cache=` (tests check it against the full
    forward), on the per-layer cache layout of `LayerCaches`.

    Args:
      model: the `QwenModel`.
      params: its parameters.
      tokens: `[B]` int32, the token each row appends.
      active: `[B]` bool; inactive rows keep their cache (their logits are junk).
      caches: the `LayerCaches`.

    Returns:
      `(logits [B, V] float32, caches)`.
    """
    cfg = model.config
    size = caches.max_length
    slot = jnp.where(active, caches.index, size)  # out of range: the scatter drops it
    here = jnp.arange(size)[None, :] == caches.index[:, None]
    valid = caches.valid | (here & active[:, None])
    cos, sin = rope_tables(caches.index[:, None], cfg.head_dim, cfg.rope_theta)
    x = jnp.take(params["embed_tokens"], tokens[:, None], axis=0).astype(dtype_of(cfg.dtype))
    x = constrain(x, ("batch", "length", "act_embed"))
    keys, values = [], []
    for layer, k_cache, v_cache in zip(layer_params(params, cfg), caches.keys, caches.values,
                                       strict=True):
        x, k_cache, v_cache = decoder_layer_step(model, layer, x, cos, sin, valid | here, slot,
                                                 k_cache, v_cache)
        keys.append(k_cache)
        values.append(v_cache)
    hidden = model.apply({"params": params}, x[:, 0], method=lambda m, h: m.norm(h))
    logits = model.apply({"params": params}, hidden, method=QwenModel.logits)
    caches = LayerCaches(keys=tuple(keys), values=tuple(values), valid=valid,
                         index=caches.index + active.astype(jnp.int32))
    return logits, caches


# ---------------------------------------------------------------------------
# Decode state.
# ---------------------------------------------------------------------------


@flax.struct.dataclass
class RowSampling:
    """Per-row sampling parameters, all `[B]`.

    Attributes:
      temperature: float32 ≥ 0 (0: greedy).
      top_k: int32 (0: off).
      top_p: float32 in (0, 1] (1: off).
      seed_low, seed_high: uint32 halves of the row's 64-bit seed.
    """

    temperature: Array
    top_k: Array
    top_p: Array
    seed_low: Array
    seed_high: Array


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries.

    Attributes:
      cache: the `LayerCaches` (`S` slots per row).
      logits: `[B, V]` float32, the next-token logits of every row.
      last_token: `[B]` int32, the latest sampled token.
      count: `[B]` int32, tokens generated so far.
      budget: `[B]` int32, tokens the row may generate (0 for padding rows).
      done: `[B]` bool, the row has finished.
      stopped: `[B]` bool, it finished on a stop token.
      tokens: `[B, S]` int32, the completion (first `count` entries).
      logprobs: `[B, S]` float32, their log-probabilities.
      stop_ids: `[B, K]` int32 stop tokens (−1 = none).
      sampling: `RowSampling`.
    """

    cache: LayerCaches
    logits: Array
    last_token: Array
    count: Array
    budget: Array
    done: Array
    stopped: Array
    tokens: Array
    logprobs: Array
    stop_ids: Array
    sampling: RowSampling


def record_tokens(state: DecodeState, tokens: Array, logprobs: Array, active: Array) -> DecodeState:
    """Appends `tokens [B]` (and their log-probabilities) to the active rows; updates `done`."""
    rows = jnp.arange(tokens.shape[0])
    slot = jnp.where(active, state.count, state.tokens.shape[1])  # out of range: dropped
    out_tokens = state.tokens.at[rows, slot].set(tokens, mode="drop")
    out_logprobs = state.logprobs.at[rows, slot].set(logprobs, mode="drop")
    count = state.count + active.astype(jnp.int32)
    hit_stop = active & jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    done = state.done | hit_stop | (count >= state.budget)
    return state.replace(last_token=jnp.where(active, tokens, state.last_token), count=count,
                         done=done, stopped=state.stopped | hit_stop, tokens=out_tokens,
                         logprobs=out_logprobs)


def constrain_state(state: DecodeState) -> DecodeState:
    """Shards every per-row array over the mesh's batch axes (no-op without a mesh)."""
    def by_rank(x):
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def head_major(x):
        return constrain(x, ("batch", "act_kv_heads", "length", None))

    cache = state.cache
    cache = cache.replace(keys=tuple(map(head_major, cache.keys)),
                          values=tuple(map(head_major, cache.values)),
                          valid=by_rank(cache.valid), index=by_rank(cache.index))
    rest = jax.tree_util.tree_map(by_rank, state.replace(cache=None))
    return rest.replace(cache=cache)


# ---------------------------------------------------------------------------
# Host-side request packing.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkArrays:
    """One padded chunk of requests (numpy), ready for `prefill`."""

    tokens: np.ndarray  # [B, P] int32, right-padded with 0
    lengths: np.ndarray  # [B] int32 (1 for padding rows)
    budget: np.ndarray  # [B] int32 (0 for padding rows)
    stop_ids: np.ndarray  # [B, K] int32, −1 padded
    sampling: dict[str, np.ndarray]  # RowSampling fields
    cache_length: int
    rows: int  # real rows (the rest are padding)


def smallest_bucket(value: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ≥ `value` (buckets sorted ascending; the last one caps)."""
    for bucket in buckets:
        if bucket >= value:
            return bucket
    return buckets[-1]


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed → `(low, high)` uint32 words of `seed mod 2**64`."""
    seed %= 2**64
    return seed & UINT32_MAX, seed >> 32


class _MeshContext(contextlib.ExitStack):
    def __init__(self, mesh, rules):
        super().__init__()
        self.enter_context(jax.set_mesh(mesh))
        self.enter_context(nn.logical_axis_rules(rules))


def _progress(items: Iterable, total: int, enabled: bool) -> Iterable:
    if not enabled or total <= 1:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc="generate", unit="chunk", leave=False, file=sys.stderr)


# ---------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------


class JaxEngine:
    """Batched generation over a `Policy`'s Flax model (implements `Engine`).

    Attributes:
      policy: the `Policy` whose model (and, initially, parameters) it runs.
      params: the parameters it currently samples from (`update_params`).
      policy_version: incremented by every `update_params` (or set by it).
      trace_counts: how many times each jitted function was traced
        (`{"prefill": n, "decode": m, ...}`); a new shape bucket adds one.
        Engines of the same architecture (config and LoRA spec) share their
        jitted functions, so a second engine compiles nothing new.
      last_batch_sharding: the sharding of the last chunk's per-row arrays
        (diagnostics: with a data axis, rows are split over devices).
    """

    def __init__(
        self,
        policy,
        *,
        max_batch_size: int = 64,
        batch_buckets: Sequence[int] | None = None,
        length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
        max_total_length: int | None = None,
        seed: int = 0,
        decode_loop: str = "device",
        copy_params: bool = True,
        show_progress: bool = True,
    ):
        """Builds the engine (nothing is compiled until the first `generate`).

        Args:
          policy: an `agentrl.models.Policy` (config, params, mesh, rules, model).
          max_batch_size: most rows per jitted call; larger requests are split.
          batch_buckets: batch sizes a chunk is padded up to (default: powers
            of two from the mesh's data-parallel size up to `max_batch_size`;
            `(max_batch_size,)` compiles one batch shape only).
          length_buckets: prompt and cache lengths are padded up to one of
            these (ascending); `max_total_length` is added as the last.
          max_total_length: most prompt + completion tokens of one row
            (default: the model's `max_position_embeddings`).
          seed: seeds the stream of rows whose `SamplingParams.seed` is None.
          decode_loop: `"device"` (a `lax.while_loop` inside one jit) or
            `"host"` (a Python loop over a jitted step).
          copy_params: hold a copy of the parameters (here and in
            `update_params`), so a train step that donates its state cannot
            delete the engine's arrays; False shares the caller's buffers
            (no extra memory; only when they are never donated or deleted).
          show_progress: a progress bar over chunks when a request has several.
        """
        config = policy.config
        max_total_length = max_total_length or config.max_position_embeddings
        if max_batch_size < 1:
            raise ValueError(f"JaxEngine: max_batch_size={max_batch_size} must be >= 1.")
        if max_total_length < 2:
            raise ValueError(f"JaxEngine: max_total_length={max_total_length} must be >= 2.")
        if decode_loop not in ("device", "host"):
            raise ValueError(f"JaxEngine: decode_loop={decode_loop!r}; use 'device' or 'host'.")
        if any(b < 1 for b in length_buckets):
            raise ValueError(f"JaxEngine: length_buckets={tuple(length_buckets)} must be >= 1.")
        self.policy = policy
        self.config = config
        self.mesh = policy.mesh
        self.rules = policy.rules
        self.model: QwenModel = policy.model
        self.max_batch_size = max_batch_size
        self.max_total_length = max_total_length
        self.length_buckets = tuple(sorted({b for b in length_buckets if b < max_total_length}
                                           | {max_total_length}))
        self.decode_loop = decode_loop
        self.show_progress = show_progress
        self.batch_shards = self._batch_shards()
        if batch_buckets is None:
            batch_buckets = [self.batch_shards * 2**i for i in range(max_batch_size.bit_length())]
        if any(b < 1 for b in batch_buckets):
            raise ValueError(f"JaxEngine: batch_buckets={tuple(batch_buckets)} must be >= 1.")
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if b < max_batch_size}
                                          | {max_batch_size}))
        self.policy_version = 0
        self.last_batch_sharding = None
        self._rng = np.random.default_rng(seed)
        self._param_shardings, self._param_shapes = param_shardings(self.model, self.mesh,
                                                                    self.rules)
        self.copy_params = copy_params
        self._params = self._placed(policy.params, "JaxEngine", copy_params)
        self._compiled = compiled_decoder(config, self.model.lora)
        self._prefill = self._compiled.prefill
        self._decode = self._compiled.decode
        self._decode_step = self._compiled.decode_step

    # -- public API ----------------------------------------------------------

    @property
    def params(self) -> Any:
        return self._params

    @property
    def trace_counts(self) -> dict[str, int]:
        """Traces of the jitted functions (shared by engines of the same architecture)."""
        return dict(self._compiled.trace_counts)

    def update_params(self, params: Any, *, version: int | None = None,
                      copy: bool | None = None) -> int:
        """Swaps in new parameters (same structure, shapes and dtypes); no recompilation.

        The arrays are placed on the engine's shardings (the model's logical
        axes on the policy's mesh), so the compiled functions are reused.

        Args:
          params: the new parameter tree (e.g. the train state's, after a step).
          version: the new `policy_version` (default: the old one + 1).
          copy: copy the arrays (default: `copy_params`); without a copy the
            engine shares them when they are already on its shardings.

        Returns:
          The new `policy_version`.
        """
        self._params = self._placed(params, "update_params",
                                    self.copy_params if copy is None else copy)
        self.policy_version = self.policy_version + 1 if version is None else int(version)
        return self.policy_version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """One `Completion` per prompt, in order (see the module docstring)."""
        requests = per_prompt_params(prompts, params)
        prompts = [self._check_prompt(index, prompt) for index, prompt in enumerate(prompts)]
        for index, request in enumerate(requests):
            self._check_request(index, request)
        seeds = [split_seed(r.seed if r.seed is not None else int(self._rng.integers(2**63)))
                 for r in requests]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        chunks = [order[i:i + self.max_batch_size]
                  for i in range(0, len(order), self.max_batch_size)]
        results: list[Completion | None] = [None] * len(prompts)
        for chunk in _progress(chunks, len(chunks), self.show_progress):
            arrays = self._pack([prompts[i] for i in chunk], [requests[i] for i in chunk],
                                [seeds[i] for i in chunk])
            for index, completion in zip(chunk, self._run_chunk(arrays), strict=False):
                results[index] = completion
        return results

    # -- validation ----------------------------------------------------------

    def _check_prompt(self, index: int, prompt: Sequence[int]) -> np.ndarray:
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError(
                f"generate: prompt {index} is empty; pass at least one token id (e.g. the chat "
                "template's prefix or the BOS token)."
            )
        if ids.size >= self.max_total_length:
            raise ValueError(
                f"generate: prompt {index} has {ids.size} tokens, but max_total_length="
                f"{self.max_total_length} leaves no room to generate; truncate the prompt or build "
                "JaxEngine with a larger max_total_length."
            )
        bad = np.flatnonzero((ids < 0) | (ids >= self.config.vocab_size))
        if bad.size:
            raise ValueError(
                f"generate: prompt {index} has token id {int(ids[bad[0]])} at position "
                f"{int(bad[0])}, outside the model's vocabulary [0, {self.config.vocab_size}); "
                "encode it with the policy's tokenizer."
            )
        return ids.astype(np.int32)

    def _check_request(self, index: int, request: SamplingParams) -> None:
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"generate: SamplingParams {index} has stop_token_ids {bad} outside the model's "
                f"vocabulary [0, {self.config.vocab_size}); use the policy tokenizer's "
                "stop_token_ids."
            )

    def _placed(self, params: Any, caller: str, copy: bool) -> Any:
        """`params` checked and put on the engine's shardings (a fresh copy when `copy`)."""
        self._check_params(params, caller)
        return jax.device_put(params, self._param_shardings, may_alias=False if copy else None)

    def _check_params(self, params: Any, caller: str) -> None:
        """Same tree, shapes and dtypes as the model's parameters, else a ValueError naming it."""
        want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(self._param_shapes)
        got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(params)
        if want_tree != got_tree:
            raise ValueError(
                f"{caller}: the parameter tree has a different structure from the model's "
                f"(LoRA rank {self.model.lora.rank}, scan_layers={self.config.scan_layers}); pass "
                "the policy's params (merge or split LoRA adapters to match)."
            )
        for (path, want), (_, got) in zip(want_leaves, got_leaves, strict=True):
            if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
                raise ValueError(
                    f"{caller}: {jax.tree_util.keystr(path)} is {got.dtype}{list(got.shape)} but "
                    f"the model expects {want.dtype}{list(want.shape)}; cast or reshape to match "
                    "(another architecture needs another engine)."
                )

    # -- packing -------------------------------------------------------------

    def _batch_shards(self) -> int:
        sizes = dict(self.mesh.shape)
        spec = nn.logical_to_mesh_axes(("batch",), self.rules)[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
        return int(np.prod([sizes.get(axis, 1) for axis in axes]))

    def _pack(self, prompts, requests, seeds) -> ChunkArrays:
        rows = len(prompts)
        batch = smallest_bucket(rows, self.batch_buckets)
        lengths = np.ones((batch,), np.int32)
        lengths[:rows] = [len(p) for p in prompts]
        budget = np.zeros((batch,), np.int32)
        budget[:rows] = [min(r.max_new_tokens, self.max_total_length - len(p))
                         for p, r in zip(prompts, requests, strict=True)]
        prompt_length = smallest_bucket(int(lengths.max()), self.length_buckets)
        cache_length = smallest_bucket(int((lengths + budget).max()), self.length_buckets)
        tokens = np.zeros((batch, prompt_length), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = prompt
        most_stops = max([len(r.stop_token_ids) for r in requests] + [STOP_IDS_MIN])
        stop_ids = np.full((batch, 1 << (most_stops - 1).bit_length()), -1, np.int32)
        for row, request in enumerate(requests):
            stop_ids[row, :len(request.stop_token_ids)] = request.stop_token_ids

        def column(values, dtype, fill):
            out = np.full((batch,), fill, dtype)
            out[:rows] = values
            return out

        sampling = {
            "temperature": column([r.temperature for r in requests], np.float32, 0.0),
            "top_k": column([min(r.top_k, self.config.vocab_size) for r in requests], np.int32, 0),
            "top_p": column([r.top_p for r in requests], np.float32, 1.0),
            "seed_low": column([s[0] for s in seeds], np.uint32, 0),
            "seed_high": column([s[1] for s in seeds], np.uint32, 0),
        }
        return ChunkArrays(tokens, lengths, budget, stop_ids, sampling, cache_length, rows)

    # -- running -------------------------------------------------------------

    def _run_chunk(self, arrays: ChunkArrays) -> list[Completion]:
        with _MeshContext(self.mesh, self.rules):
            state = self._prefill(self._params, arrays.tokens, arrays.lengths, arrays.budget,
                                  arrays.stop_ids, arrays.sampling,
                                  cache_length=arrays.cache_length)
            if self.decode_loop == "device":
                state = self._decode(self._params, state)
            else:
                while not bool(jnp.all(state.done)):
                    state = self._decode_step(self._params, state)
            self.last_batch_sharding = state.tokens.sharding
            tokens, logprobs, count, stopped = jax.device_get(
                (state.tokens, state.logprobs, state.count, state.stopped))
        return [
            Completion(token_ids=tokens[row, :count[row]].tolist(),
                       logprobs=logprobs[row, :count[row]].tolist(),
                       finish_reason="stop" if stopped[row] else "length")
            for row in range(arrays.rows)
        ]


# ---------------------------------------------------------------------------
# The jitted functions, shared by every engine of one architecture.
# ---------------------------------------------------------------------------


class CompiledDecoder:
    """`prefill`, `decode` (device loop) and `decode_step` (one step) of one `QwenModel`.

    Attributes:
      model: the `QwenModel(config, lora)`.
      trace_counts: traces per function (each trace is a compile).
    """

    def __init__(self, config, lora):
        self.model = QwenModel(config, lora)
        self.trace_counts = {"prefill": 0, "decode": 0, "decode_step": 0}
        self.prefill = jax.jit(self._prefill, static_argnames=("cache_length",))
        self.decode = jax.jit(self._decode, donate_argnames=("state",))
        self.decode_step = jax.jit(self._decode_step, donate_argnames=("state",))

    def _prefill(self, params, tokens, lengths, budget, stop_ids, sampling, *, cache_length):
        """Right-padded prompts `[B, P]` → a `DecodeState` holding each row's next-token logits."""
        self.trace_counts["prefill"] += 1
        batch, prompt_length = tokens.shape
        cache = init_cache(self.model.config, batch, cache_length)
        token_mask = jnp.arange(prompt_length)[None, :] < lengths[:, None]
        out = self.model.apply({"params": params}, tokens, segment_ids=token_mask.astype(jnp.int32),
                               cache=cache)
        last_hidden = jnp.take_along_axis(out["hidden"], (lengths - 1)[:, None, None], axis=1)
        logits = self.model.apply({"params": params}, last_hidden[:, 0], method=QwenModel.logits)
        state = DecodeState(
            cache=LayerCaches.from_kv_cache(out["cache"]),
            logits=logits,
            last_token=jnp.zeros((batch,), jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
            budget=budget,
            done=budget <= 0,
            stopped=jnp.zeros((batch,), bool),
            tokens=jnp.zeros((batch, cache_length), jnp.int32),
            logprobs=jnp.zeros((batch, cache_length), jnp.float32),
            stop_ids=stop_ids,
            sampling=RowSampling(**sampling),
        )
        return constrain_state(state)

    def _step(self, params, state: DecodeState) -> DecodeState:
        """Samples every unfinished row's next token, records it and feeds it to the model.

        The last iteration feeds a batch whose rows are all done (one wasted
        model step per chunk): skipping it with `lax.cond` makes XLA copy
        every cache buffer on every step (measured: 12 copies of `[B, K, S,
        H]` per step), which costs far more.
        """
        active = ~state.done
        tokens, logprobs = sample_tokens(state.logits, state.sampling, state.count)
        state = record_tokens(state, tokens, logprobs, active)
        logits, cache = decode_logits(self.model, params, state.last_token, ~state.done,
                                      state.cache)
        return constrain_state(state.replace(logits=logits, cache=cache))

    def _decode(self, params, state: DecodeState) -> DecodeState:
        """Steps until every row is done (`lax.while_loop`)."""
        self.trace_counts["decode"] += 1
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: self._step(params, s),
                                  state)

    def _decode_step(self, params, state: DecodeState) -> DecodeState:
        self.trace_counts["decode_step"] += 1
        return self._step(params, state)


@functools.lru_cache(maxsize=16)
def compiled_decoder(config, lora) -> CompiledDecoder:
    """The shared `CompiledDecoder` of an architecture (`QwenConfig`, `LoraSpec`)."""
    return CompiledDecoder(config, lora)
