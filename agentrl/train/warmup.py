"""CARL critic warm-up and its verification gate (SPEC §9.4; CARL seed App. C).

Critic-only training on the base policy's segment rollouts; every evaluation
checks the gate on a held-out split, and PPO starts only once all hold
(unless `warmup.require_gate` is False):

* AUC of `V(s_0)` separating Tier 2 from Tier 1 prompts ≥ 0.70 (Tier 2:
  answered correctly by at least one of 5 no-tool rollouts);
* sign accuracy ≥ 0.60: the fraction of intermediate boundaries where the
  value moves toward the eventual outcome, `sign(V_{k+1} − V_k) = sign(R − V_k)`;
* explained variance ≥ 0.45: `1 − Var(R − V) / Var(R)` over all boundary states;
* ECE over 10 equal-width bins is reported too.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentrl.rollout.segments import SegmentConfig, run_segment_rollout


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve (probability a positive outscores a negative; ties ½)."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, bool)
    positives, negatives = scores[labels], scores[~labels]
    if len(positives) == 0 or len(negatives) == 0:
        return float("nan")
    greater = (positives[:, None] > negatives[None, :]).sum()
    ties = (positives[:, None] == negatives[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(positives) * len(negatives)))


def sign_accuracy(episodes: Sequence[tuple[Sequence[float], float]]) -> float:
    """Fraction of intermediate boundaries k where `sign(V_{k+1} − V_k) = sign(R − V_k)`.

    Args:
      episodes: `(boundary values V_0..V_N, outcome R)` per episode.
    """
    hits = total = 0
    for values, reward in episodes:
        for k in range(len(values) - 1):
            total += 1
            hits += np.sign(values[k + 1] - values[k]) == np.sign(reward - values[k])
    return float(hits / total) if total else float("nan")


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """`1 − Var(R − V) / Var(R)` over all boundary states."""
    values, returns = np.asarray(values, np.float64), np.asarray(returns, np.float64)
    variance = returns.var()
    return float(1.0 - (returns - values).var() / variance) if variance > 0 else float("nan")


def expected_calibration_error(probabilities: Sequence[float], outcomes: Sequence[float],
                               bins: int = 10) -> float:
    """ECE over `bins` equal-width bins of the predicted success probability."""
    p = np.clip(np.asarray(probabilities, np.float64), 0.0, 1.0)
    y = np.asarray(outcomes, np.float64)
    index = np.minimum((p * bins).astype(int), bins - 1)
    error = 0.0
    for b in range(bins):
        members = index == b
        if members.any():
            error += members.mean() * abs(p[members].mean() - y[members].mean())
    return float(error)


def gate_metrics(episodes: Sequence[tuple[Sequence[float], float]], tier2: Sequence[bool]
                 ) -> dict[str, float]:
    """The four gate numbers of SPEC §9.4 from episodes' boundary values and tiers."""
    first = [values[0] for values, _ in episodes]
    all_values = [v for values, _ in episodes for v in values]
    all_returns = [r for values, r in episodes for _ in values]
    return {
        "warmup/auc": auc(first, tier2),
        "warmup/sign_accuracy": sign_accuracy(episodes),
        "warmup/explained_variance": explained_variance(all_values, all_returns),
        "warmup/ece": expected_calibration_error(all_values, all_returns),
    }


def gate_passes(metrics: dict[str, float], config) -> bool:
    def ok(key, threshold):
        value = metrics.get(key, float("nan"))
        return bool(np.isfinite(value) and value >= threshold)

    return (ok("warmup/auc", config.auc) and ok("warmup/sign_accuracy", config.sign_accuracy)
            and ok("warmup/explained_variance", config.explained_variance))


def _episodes(trainer, pairs):
    """`(boundary values, R)` per episode from view rows and their token values."""
    trajectories = [t for _, t in pairs]
    batch = trainer._collate(trajectories)
    from agentrl.train.loop import _boundary_values, _segment_ids

    with trainer._context():
        values = np.asarray(trainer._values(trainer.state.params, batch.tokens,
                                            _segment_ids(batch)))
    boundary = _boundary_values(trajectories, values, batch)
    seen, out = set(), []
    for row, t in enumerate(trajectories):
        key = (t.prompt_id, t.metadata["episode"])
        if key in seen:
            continue
        seen.add(key)
        count = len(t.metadata["boundaries"])
        out.append((boundary[row, :count].tolist(), float(t.outcome), t.prompt_id))
    return out


def _tiers(trainer, instances, samples: int = 5) -> dict[str, bool]:
    """Tier 2 iff one of `samples` no-tool (single-segment) rollouts answers correctly."""
    from agentrl.models.chat import encode_messages

    prompts = [(i.prompt.prompt_id, encode_messages(trainer.tokenizer, list(i.prompt.messages),
                                                    add_generation_prompt=True))
               for i in instances]
    r = trainer.config.rollout
    config = SegmentConfig(max_segments=1, max_segment_tokens=r.max_step_tokens,
                           max_context_tokens=r.max_context_tokens)
    episodes = run_segment_rollout(trainer.engine, trainer.tokenizer, prompts,
                                   lambda code: "", config, group_size=samples)
    by_id = {i.prompt.prompt_id: i for i in instances}
    tiers: dict[str, bool] = {}
    for views in episodes:
        view = views[-1]
        answer = view.metadata.get("answer")
        correct = answer is not None and trainer.task.reward(
            by_id[view.prompt_id], f"\\boxed{{{answer}}}") >= 1.0
        tiers[view.prompt_id] = tiers.get(view.prompt_id, False) or correct
    return tiers


def critic_warmup(trainer) -> dict[str, float]:
    """Critic-only steps on base-policy rollouts until the gate passes (SPEC §9.4)."""
    c = trainer.config
    if trainer.spec.value == "none":
        raise ValueError("warmup.steps > 0 needs a critic: set value.mode to 'shared' or "
                         "'separate'.")
    holdout = trainer.eval_instances
    tiers = _tiers(trainer, holdout)
    update = jax.jit(functools.partial(_critic_only_step, trainer.spec, trainer.loss,
                                       trainer.txs))
    metrics: dict[str, float] = {}
    for step in range(c.warmup.steps):
        instances = trainer._next_instances(c.rollout.prompts_per_step)
        pairs = trainer.rollout(instances, seed=-(step + 1))
        trajectories = [t for _, t in pairs]
        batch = trainer._collate(trajectories)
        from agentrl.train.loop import _boundary_targets, _segment_ids

        positions, weights, targets = _boundary_targets(trajectories, batch)
        with trainer._context():
            trainer.state, loss = update(trainer.state, batch.tokens, _segment_ids(batch),
                                         positions, weights, targets)
        metrics["warmup/critic_loss"] = float(loss)
        if (step + 1) % max(1, c.warmup.steps // 5) == 0 or step + 1 == c.warmup.steps:
            episodes = _episodes(trainer, trainer.rollout(holdout, greedy=True, group_size=1))
            metrics.update(gate_metrics([(v, r) for v, r, _ in episodes],
                                        [tiers.get(p, False) for _, _, p in episodes]))
            metrics["warmup/gate"] = float(gate_passes(metrics, c.warmup))
            trainer.log(f"warm-up step {step + 1}: " + " ".join(
                f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items()))
            if metrics["warmup/gate"]:
                break
    if c.warmup.require_gate and not metrics.get("warmup/gate"):
        raise RuntimeError(
            f"the CARL verification gate did not pass after {c.warmup.steps} warm-up steps "
            f"({metrics}); raise warmup.steps, or set warmup.require_gate=False to start PPO "
            "anyway.")
    return metrics


def _critic_only_step(spec, loss, txs, state, tokens, segment_ids, positions, weights, targets):
    """One critic-only optimizer step (the actor channel untouched)."""
    import optax

    from agentrl.train.step import TrainBatch, critic_loss

    key = "value_head" if spec.value == "shared" else "critic"
    batch = TrainBatch(tokens=tokens, segment_ids=segment_ids, loss_mask=segment_ids > 0,
                       step_id=jnp.zeros_like(tokens), advantages=jnp.zeros(tokens.shape),
                       old_logp=jnp.zeros(tokens.shape), rollout_logp=jnp.zeros(tokens.shape),
                       row_weights=jnp.ones(tokens.shape[0]), critic_positions=positions,
                       critic_weights=weights, critic_targets=targets)

    def objective(critic_params):
        value, _ = critic_loss(spec, loss.__class__(**{**loss.__dict__, "critic": "boundary"}),
                               {**state.params, key: critic_params}, batch)
        return value

    value, grads = jax.value_and_grad(objective)(state.params[key])
    updates, opt = txs["critic"].update(grads, state.opt_state["critic"], state.params[key])
    params = {**state.params, key: optax.apply_updates(state.params[key], updates)}
    return state.replace(params=params, opt_state={**state.opt_state, "critic": opt}), value
