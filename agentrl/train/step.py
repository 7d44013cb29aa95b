"""The jitted update: PPO epochs over mini-batches, critic loss, KL, entropy; SFT.

`ppo_update(state, batch)` runs `epochs × num_minibatches` optimizer steps in
one `jax.jit` (a `lax.scan` over shuffled mini-batches per epoch). Each step:

* recompute the policy's log-probabilities and entropies of the batch's tokens
  with the chunked path (`token_logprobs_and_entropy`: no `[B, T, V]` logits);
* actor loss = aggregate(PPO clipped term × row weight × optional truncated IS
  weight) + β_KL · KL(π ‖ π_ref) − c_H · entropy (SPEC §10);
* critic loss (value models): token-level clipped value loss against GAE
  returns, or CARL's Monte-Carlo loss at boundary positions (SPEC §9.3);
* gradients per channel (`agentrl.train.state`); a step whose loss or
  gradients are not finite is skipped (parameters and optimizer state kept)
  and counted in `TrainState.skipped`.
"""

import dataclasses
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax

from agentrl import losses
from agentrl.models.qwen import QwenModel, token_logprobs_and_entropy
from agentrl.train.state import ModelSpec, TrainState, channel_params


@flax.struct.dataclass
class TrainBatch:
    """A padded device batch for the update (B rows, T tokens, S boundaries).

    Attributes:
      tokens: `[B, T]` int32.
      segment_ids: `[B, T]` int32, 0 on padding (attention segments).
      loss_mask: `[B, T]` bool, the policy tokens.
      step_id: `[B, T]` int32 segment/step ids (`segment_mean_sum`).
      advantages: `[B, T]` per-token advantages.
      old_logp: `[B, T]` log-probabilities of the behaviour policy, as the
        trainer computes them before the update.
      rollout_logp: `[B, T]` the engine's log-probabilities (mismatch metric,
        truncated IS).
      row_weights: `[B]` (VSPO slot weights; ones otherwise).
      ref_logp: `[B, T]` the frozen reference policy's, or None.
      returns, old_values: `[B, T]` token critic targets and rollout values.
      critic_positions: `[B, S]` int32 boundary positions (CARL), value read
        from the hidden state of the token before.
      critic_weights: `[B, S]` each boundary's weight in the MC loss.
      critic_targets: `[B, S]` the terminal reward R of its episode.
      score_index: `[B, P]` int32 positions whose tokens are scored (the
        policy tokens, padded with 0), or None to score every position.
        Scoring only these saves the LM-head work on prompt and tool tokens.
    """

    tokens: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    step_id: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    rollout_logp: jax.Array
    row_weights: jax.Array
    ref_logp: jax.Array | None = None
    returns: jax.Array | None = None
    old_values: jax.Array | None = None
    critic_positions: jax.Array | None = None
    critic_weights: jax.Array | None = None
    critic_targets: jax.Array | None = None
    score_index: jax.Array | None = None

    def assert_shapes(self) -> None:
        """chex checks of the documented shapes (static; free under jit)."""
        rows, length = self.tokens.shape
        chex.assert_shape([self.segment_ids, self.loss_mask, self.step_id, self.advantages,
                           self.old_logp, self.rollout_logp], (rows, length))
        chex.assert_shape(self.row_weights, (rows,))
        for name in ("ref_logp", "returns", "old_values"):
            if getattr(self, name) is not None:
                chex.assert_shape(getattr(self, name), (rows, length))
        if self.critic_positions is not None:
            chex.assert_rank(self.critic_positions, 2)
            chex.assert_equal_shape([self.critic_positions, self.critic_weights,
                                     self.critic_targets])
            chex.assert_axis_dimension(self.critic_positions, 0, rows)
        if self.score_index is not None:
            chex.assert_rank(self.score_index, 2)
            chex.assert_axis_dimension(self.score_index, 0, rows)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss settings (SPEC §10)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    value_clip: float | None = None
    critic: str = "none"  # "none" | "token" | "boundary"
    tis_cap: float | None = None

    def __post_init__(self):
        if self.critic not in ("none", "token", "boundary"):
            raise ValueError(f"LossConfig.critic={self.critic!r}; use 'none', 'token' or "
                             "'boundary'.")
        if self.aggregation not in losses.AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation={self.aggregation!r}; use one of "
                             f"{losses.AGGREGATIONS}.")


def _shift_right(x: jax.Array) -> jax.Array:
    """`[B, T-1]` per-target values → `[B, T]` aligned with the target tokens."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def policy_forward(spec: ModelSpec, params: dict[str, Any], tokens, segment_ids,
                   score_index=None):
    """`(logp [B, T], entropy [B, T], hidden [B, T, D])`; logp[t] = log π(tokens[t] | < t).

    With `score_index [B, P]` only those positions are scored (the others are
    0): the hidden state before each is gathered first, so the LM head runs on
    `B × P` instead of `B × T` positions.
    """
    model: QwenModel = spec.policy
    hidden = model.apply({"params": params["policy"]}, tokens, segment_ids=segment_ids)["hidden"]
    unembed = model.apply({"params": params["policy"]}, method=QwenModel.unembedding)
    chunk = spec.config.logits_chunk_size
    if score_index is None:
        logp, entropy = token_logprobs_and_entropy(hidden[:, :-1], tokens[:, 1:], unembed,
                                                   chunk_size=chunk)
        return _shift_right(logp), _shift_right(entropy), hidden
    before = jnp.maximum(score_index - 1, 0)
    gathered = jnp.take_along_axis(hidden, before[:, :, None], axis=1)
    targets = jnp.take_along_axis(tokens, score_index, axis=1)
    logp, entropy = token_logprobs_and_entropy(gathered, targets, unembed, chunk_size=chunk)
    valid = score_index > 0
    rows = jnp.arange(tokens.shape[0])[:, None]
    dense_logp = jnp.zeros(tokens.shape, logp.dtype).at[rows, score_index].add(
        jnp.where(valid, logp, 0.0))
    dense_entropy = jnp.zeros(tokens.shape, entropy.dtype).at[rows, score_index].add(
        jnp.where(valid, entropy, 0.0))
    return dense_logp, dense_entropy, hidden


def score_positions(loss_mask, width: int | None = None):
    """`[B, width]` int32: each row's policy-token positions, padded with 0 (host, numpy).

    `width=None` picks the smallest power of two (≥ 16) that fits every row,
    so batches of similar lengths share one compiled update.
    """
    import numpy as np

    loss_mask = np.asarray(loss_mask, bool)
    if width is None:
        most = int(loss_mask.sum(axis=1).max(initial=1))
        width = 16
        while width < most:
            width *= 2
        width = min(width, loss_mask.shape[1])
    index = np.zeros((loss_mask.shape[0], width), np.int32)
    for row, mask in enumerate(loss_mask):
        positions = np.flatnonzero(mask)
        if len(positions) > width:
            raise ValueError(f"row {row} has {len(positions)} policy tokens but score width is "
                             f"{width}; raise it (rollout.max_steps × rollout.max_step_tokens).")
        index[row, : len(positions)] = positions
    return index


def token_values(spec: ModelSpec, params: dict[str, Any], tokens, segment_ids, hidden=None):
    """`[B, T]`: V of the state before each token (the head on the previous hidden state)."""
    if spec.value == "shared":
        if hidden is None:
            hidden = spec.policy.apply({"params": params["policy"]}, tokens,
                                       segment_ids=segment_ids)["hidden"]
        values = spec.value_head().apply({"params": params["value_head"]}, hidden)
    elif spec.value == "separate":
        trunk = spec.critic_trunk.apply({"params": params["critic"]["backbone"]}, tokens,
                                        segment_ids=segment_ids)["hidden"]
        values = spec.value_head().apply({"params": params["critic"]["value_head"]}, trunk)
    else:
        raise ValueError("token_values: the model has no value function (ModelSpec.value='none').")
    return _shift_right(values[:, :-1])


def actor_loss(spec: ModelSpec, loss: LossConfig, params, batch: TrainBatch):
    """Actor objective and its metrics (SPEC §10)."""
    logp, entropy, hidden = policy_forward(spec, params, batch.tokens, batch.segment_ids,
                                           batch.score_index)
    mask = batch.loss_mask
    per_token = losses.ppo_clip_loss(logp, batch.old_logp, batch.advantages,
                                     clip_low=loss.clip_low, clip_high=loss.clip_high,
                                     dual_clip=loss.dual_clip)
    if loss.tis_cap is not None:
        weights = losses.truncated_importance_weights(batch.old_logp, batch.rollout_logp,
                                                      cap=loss.tis_cap)
        per_token = per_token * jax.lax.stop_gradient(weights)
    per_token = per_token * batch.row_weights[:, None]
    policy_loss = losses.aggregate_loss(per_token, mask, loss.aggregation,
                                        segment_ids=batch.step_id, norm_length=loss.norm_length)
    entropy_mean = losses.aggregate_loss(entropy, mask, "token_mean")
    total = policy_loss - loss.entropy_coef * entropy_mean
    metrics = {"policy_loss": policy_loss, "entropy": entropy_mean}
    if batch.ref_logp is not None:
        kl = losses.aggregate_loss(losses.kl_divergence(logp, batch.ref_logp, loss.kl_kind),
                                   mask, "token_mean")
        total = total + loss.kl_coef * kl
        metrics["kl"] = kl
    ratio = jnp.exp(losses.log_ratio(logp, batch.old_logp))
    clipped = (ratio < 1 - loss.clip_low) | (ratio > 1 + loss.clip_high)
    metrics["clip_fraction"] = losses.aggregate_loss(clipped.astype(jnp.float32), mask,
                                                     "token_mean")
    metrics["approx_kl_old"] = losses.aggregate_loss(
        losses.kl_divergence(batch.old_logp, logp, "k3"), mask, "token_mean")
    return total, (metrics, hidden)


def critic_loss(spec: ModelSpec, loss: LossConfig, params, batch: TrainBatch, hidden=None):
    """Token GAE value loss, or CARL's boundary Monte-Carlo loss (SPEC §9.3, §10)."""
    values = token_values(spec, params, batch.tokens, batch.segment_ids, hidden)
    if loss.critic == "token":
        per_token = losses.value_loss(values, batch.returns, batch.old_values,
                                      clip_range=loss.value_clip)
        return losses.aggregate_loss(per_token, batch.loss_mask, "token_mean"), values
    at_boundaries = jnp.take_along_axis(values, batch.critic_positions, axis=1)
    squared = (at_boundaries - batch.critic_targets) ** 2
    total_weight = jnp.maximum(batch.critic_weights.sum(), 1e-9)
    return (batch.critic_weights * squared).sum() / total_weight, values


def _finite(tree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _select(condition, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(condition, a, b), new, old)


def minibatch_step(spec: ModelSpec, loss: LossConfig, txs: dict[str, optax.GradientTransformation],
                   state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
    """One optimizer step on one mini-batch, all channels."""
    params = state.params

    def actor_objective(policy_params):
        return actor_loss(spec, loss, {**params, "policy": policy_params}, batch)

    (actor_value, (metrics, _)), actor_grads = jax.value_and_grad(
        actor_objective, has_aux=True)(params["policy"])
    grads = {"actor": actor_grads}
    total = actor_value
    if loss.critic != "none" and spec.value != "none":
        key = "value_head" if spec.value == "shared" else "critic"

        def critic_objective(critic_params, policy_params):
            merged = {**params, key: critic_params, "policy": policy_params}
            value, _ = critic_loss(spec, loss, merged, batch)
            return loss.value_coef * value

        critic_value, (critic_grads, backbone_grads) = jax.value_and_grad(
            critic_objective, argnums=(0, 1))(params[key], params["policy"])
        grads["critic"] = critic_grads
        if "critic_backbone" in txs:
            grads["critic_backbone"] = backbone_grads
        metrics["critic_loss"] = critic_value / loss.value_coef
        total = total + critic_value
    finite = jnp.isfinite(total) & _finite(grads)
    new_params = dict(params)
    new_opt = dict(state.opt_state)
    for name, tx in txs.items():
        if name not in grads:
            continue
        target = "policy" if name in ("actor", "critic_backbone") else (
            "value_head" if spec.value == "shared" else "critic")
        current = new_params[target]
        updates, opt = tx.update(grads[name], state.opt_state[name], current)
        new_params[target] = _select(finite, optax.apply_updates(current, updates), current)
        new_opt[name] = _select(finite, opt, state.opt_state[name])
    metrics["loss"] = total
    metrics["grad_norm"] = optax.tree.norm(grads["actor"])
    metrics["finite"] = finite.astype(jnp.float32)
    new_state = state.replace(params=new_params, opt_state=new_opt,
                              step=state.step + finite.astype(jnp.int32),
                              skipped=state.skipped + (~finite).astype(jnp.int32))
    return new_state, metrics


def _split_minibatches(batch: TrainBatch, order: jax.Array, num_minibatches: int) -> TrainBatch:
    def split(x):
        if x is None:
            return None
        x = jnp.take(x, order, axis=0)
        return x.reshape((num_minibatches, x.shape[0] // num_minibatches, *x.shape[1:]))

    return jax.tree_util.tree_map(split, batch)


def ppo_update(spec: ModelSpec, loss: LossConfig, txs, state: TrainState, batch: TrainBatch, *,
               epochs: int = 1, num_minibatches: int = 1) -> tuple[TrainState, dict]:
    """`epochs` passes over `num_minibatches` shuffled mini-batches (jit this with static args).

    Args:
      batch: `TrainBatch` of B rows × T tokens (shapes checked with chex).

    Returns the new state and the metrics averaged over all optimizer steps.
    """
    batch.assert_shapes()
    rows = batch.tokens.shape[0]
    if rows % num_minibatches:
        raise ValueError(f"batch of {rows} rows does not split into num_minibatches="
                         f"{num_minibatches}; make the batch a multiple of it.")

    def epoch(state, _):
        rng, shuffle = jax.random.split(state.rng)
        order = jax.random.permutation(shuffle, rows)
        minibatches = _split_minibatches(batch, order, num_minibatches)
        state, metrics = jax.lax.scan(
            lambda s, mb: minibatch_step(spec, loss, txs, s, mb), state.replace(rng=rng),
            minibatches)
        return state, metrics

    state, metrics = jax.lax.scan(epoch, state, None, length=epochs)
    return state, jax.tree_util.tree_map(jnp.mean, metrics)


def sft_loss(spec: ModelSpec, params, tokens, segment_ids, loss_mask, score_index=None,
             norm_tokens=None):
    """Mean negative log-likelihood of the demonstration's assistant tokens.

    `tokens`, `segment_ids`, `loss_mask`: `[B, T]`; `score_index`: `[B, P]` or None.
    `norm_tokens` (scalar) divides the batch's summed NLL instead of its own
    token count: with batches grouped by length, a batch of short examples
    has fewer loss tokens, and its own count would weight each of its tokens
    more than a mixed batch does. Passing the expected count of a batch
    (`B ×` the mean loss tokens per example) keeps every token's weight that
    of the dataset's token mean.
    """
    chex.assert_equal_shape([tokens, segment_ids, loss_mask])
    logp, _, _ = policy_forward(spec, params, tokens, segment_ids, score_index)
    if norm_tokens is None:
        return -losses.aggregate_loss(logp, loss_mask, "token_mean")
    chex.assert_rank(norm_tokens, 0)
    return -jnp.sum(jnp.where(loss_mask, logp, 0.0)) / norm_tokens


def sft_update(spec: ModelSpec, tx: optax.GradientTransformation, state: TrainState,
               tokens, segment_ids, loss_mask, score_index=None, norm_tokens=None
               ) -> tuple[TrainState, dict]:
    """One SFT step on the actor channel (non-finite steps are skipped; `sft_loss`)."""
    value, grads = jax.value_and_grad(
        lambda p: sft_loss(spec, {**state.params, "policy": p}, tokens, segment_ids, loss_mask,
                           score_index, norm_tokens)
    )(state.params["policy"])
    finite = jnp.isfinite(value) & _finite(grads)
    updates, opt = tx.update(grads, state.opt_state["actor"], state.params["policy"])
    policy = _select(finite, optax.apply_updates(state.params["policy"], updates),
                     state.params["policy"])
    new_state = state.replace(
        params={**state.params, "policy": policy},
        opt_state={**state.opt_state, "actor": _select(finite, opt, state.opt_state["actor"])},
        step=state.step + finite.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32))
    return new_state, {"sft_loss": value, "grad_norm": optax.tree.norm(grads),
                       "finite": finite.astype(jnp.float32)}


def compute_logprobs(spec: ModelSpec, params, tokens, segment_ids, score_index=None
                     ) -> jax.Array:
    """`[B, T]` log-probabilities of the tokens under `params` (old / reference policy)."""
    logp, _, _ = policy_forward(spec, params, tokens, segment_ids, score_index)
    return logp


__all__ = [
    "LossConfig",
    "TrainBatch",
    "actor_loss",
    "channel_params",
    "compute_logprobs",
    "critic_loss",
    "minibatch_step",
    "policy_forward",
    "ppo_update",
    "score_positions",
    "sft_loss",
    "sft_update",
    "token_values",
]
