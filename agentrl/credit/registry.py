"""The `CreditScheme` interface, its registry, and the built-in schemes.

A scheme turns a `Batch` (rewards and, if it needs them, critic values) into
per-token advantages `[B, T]` and optional per-row weights `[B]`. Adding one is
a pure function plus one decorator; the trainer looks schemes up by name
(`config.credit.scheme`), so no trainer edit is needed:

    @register_scheme("my_scheme")
    def my_scheme(batch: Batch, *, temperature: float = 1.0) -> CreditOutput:
        ...

Keyword-only arguments with defaults are the scheme's options; they are static
under `jax.jit`. `docs/adding_a_credit_scheme.md` walks through an example.
A batch transform (VSPO) rewrites the batch before any group scheme runs.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp

from agentrl.credit.broadcast import (
    step_token_counts,
    steps_to_tokens,
    trajectory_to_tokens,
    turn_steps_to_tokens,
    turns_to_tokens,
)
from agentrl.credit.checklist import checklist_credit
from agentrl.credit.gae import gae_advantages, mt_ppo_token_rewards, whiten_advantages
from agentrl.credit.grpo import grpo_advantages, mt_grpo_advantages
from agentrl.credit.segment import segment_advantages
from agentrl.credit.tree import tree_credit
from agentrl.credit.vspo import vspo_resample
from agentrl.numerics import check_choice
from agentrl.types import Batch

ValuePositions = Literal["none", "token", "boundary"]


@flax.struct.dataclass
class CreditOutput:
    """What a scheme returns.

    Attributes:
      advantages: `[B, T]` per-token advantages, 0 off the policy tokens.
      row_weights: `[B]` per-row loss weights, or None for all ones.
      returns: `[B, T]` critic targets (value-based schemes), or None.
      metrics: scalar diagnostics, logged by the trainer.
    """

    advantages: chex.Array
    row_weights: chex.Array | None = None
    returns: chex.Array | None = None
    metrics: dict[str, chex.Array] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CreditScheme:
    """A registered credit-assignment scheme.

    Attributes:
      name: registry key (`config.credit.scheme`).
      fn: `fn(batch, **options) -> CreditOutput`, pure and jittable.
      needs_values: where it needs critic values: `"none"`, `"token"`
        (`Batch.values`, `[B, T]`) or `"boundary"` (`Batch.boundary_values`,
        `[B, S]`, the state before each step/segment).
      options: option names and defaults (the keyword-only arguments of fn).
      loss_aggregation: the `aggregate_loss` mode of the paper's objective
        (`seq_mean_token_mean` for the per-sequence token means of GRPO eq. 3,
        MT-GRPO/MT-PPO eq. 8, PORTool eq. 1; `token_mean` where the paper does
        not say).
      description: one line for `agentrl` listings and docs.
    """

    name: str
    fn: Callable[..., CreditOutput]
    needs_values: ValuePositions
    options: Mapping[str, Any]
    loss_aggregation: str
    description: str

    def resolve(self, **overrides) -> dict[str, Any]:
        """Defaults updated by `overrides`; unknown option names raise."""
        unknown = sorted(set(overrides) - set(self.options))
        if unknown:
            raise ValueError(
                f"credit scheme {self.name!r} has no option(s) {unknown}; its options are "
                f"{dict(self.options)}."
            )
        return {**self.options, **overrides}

    def __call__(self, batch: Batch, **options) -> CreditOutput:
        return self.fn(batch, **self.resolve(**options))

    def jit(self, **options) -> Callable[[Batch], CreditOutput]:
        """The scheme with its options fixed, jitted (options are static)."""
        return jax.jit(functools.partial(self.fn, **self.resolve(**options)))


@dataclasses.dataclass(frozen=True)
class BatchTransform:
    """A registered batch transform: `fn(batch, key, **options) -> (batch, row_weights [B])`."""

    name: str
    fn: Callable[..., tuple[Batch, chex.Array]]
    options: Mapping[str, Any]
    description: str

    def __call__(self, batch: Batch, key: chex.PRNGKey, **options) -> tuple[Batch, chex.Array]:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(
                f"batch transform {self.name!r} has no option(s) {unknown}; its options are "
                f"{dict(self.options)}."
            )
        return self.fn(batch, key, **{**self.options, **options})


_SCHEMES: dict[str, CreditScheme] = {}
_TRANSFORMS: dict[str, BatchTransform] = {}


def _keyword_defaults(fn: Callable) -> dict[str, Any]:
    parameters = inspect.signature(fn).parameters.values()
    options = {}
    for p in parameters:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"option {p.name!r} of {fn.__name__} needs a default value.")
        options[p.name] = p.default
    return options


def register_scheme(
    name: str,
    *,
    needs_values: ValuePositions = "none",
    loss_aggregation: str = "token_mean",
    description: str = "",
    options: Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., CreditOutput]], Callable[..., CreditOutput]]:
    """Decorator registering `fn(batch, *, option=default, ...) -> CreditOutput`.

    Args:
      name: registry key; registering a taken name raises.
      needs_values: `"none"`, `"token"` or `"boundary"`.
      loss_aggregation: the paper's `aggregate_loss` mode.
      description: one line; defaults to the first line of fn's docstring.
      options: default overrides for fn's keyword-only options (lets one
        function back several schemes, e.g. `grpo` and `dr_grpo`).

    Returns:
      The decorator; it returns fn unchanged.
    """
    check_choice("needs_values", needs_values, ("none", "token", "boundary"))

    def decorator(fn):
        if name in _SCHEMES:
            raise ValueError(f"credit scheme {name!r} is already registered ({_SCHEMES[name].fn}).")
        defaults = _keyword_defaults(fn)
        unknown = sorted(set(options or {}) - set(defaults))
        if unknown:
            raise ValueError(
                f"register_scheme({name!r}): {fn.__name__} has no option(s) {unknown}."
            )
        doc_line = (inspect.getdoc(fn) or "").split("\n")[0]
        _SCHEMES[name] = CreditScheme(
            name=name,
            fn=fn,
            needs_values=needs_values,
            options={**defaults, **(options or {})},
            loss_aggregation=loss_aggregation,
            description=description or doc_line,
        )
        return fn

    return decorator


def register_transform(name: str, *, description: str = ""):
    """Decorator registering a batch transform `fn(batch, key, *, option=default)`."""

    def decorator(fn):
        if name in _TRANSFORMS:
            raise ValueError(f"batch transform {name!r} is already registered.")
        _TRANSFORMS[name] = BatchTransform(
            name=name,
            fn=fn,
            options=_keyword_defaults(fn),
            description=description or (inspect.getdoc(fn) or "").split("\n")[0],
        )
        return fn

    return decorator


def unregister_scheme(name: str) -> None:
    """Removes a scheme (tests and notebooks that re-register)."""
    _SCHEMES.pop(name, None)


def get_scheme(name: str) -> CreditScheme:
    """The registered scheme `name`; a KeyError lists the registered names."""
    if name not in _SCHEMES:
        raise KeyError(
            f"unknown credit scheme {name!r}; registered: {sorted(_SCHEMES)}. Register yours "
            "with @agentrl.credit.register_scheme (docs/adding_a_credit_scheme.md)."
        )
    return _SCHEMES[name]


def get_transform(name: str) -> BatchTransform:
    """The registered batch transform `name`."""
    if name not in _TRANSFORMS:
        raise KeyError(f"unknown batch transform {name!r}; registered: {sorted(_TRANSFORMS)}.")
    return _TRANSFORMS[name]


def available_schemes() -> list[str]:
    return sorted(_SCHEMES)


def available_transforms() -> list[str]:
    return sorted(_TRANSFORMS)


def compute_credit(
    batch: Batch,
    scheme: str,
    *,
    options: Mapping[str, Any] | None = None,
    transform: str | None = None,
    transform_options: Mapping[str, Any] | None = None,
    key: chex.PRNGKey | None = None,
) -> tuple[Batch, CreditOutput]:
    """Runs an optional batch transform, then a scheme; folds the row weights.

    Returns the (possibly resampled) batch, whose rows the advantages refer to,
    and the scheme's output with `row_weights` = transform weights × scheme
    weights.
    """
    weights = None
    if transform is not None:
        if key is None:
            raise ValueError(f"batch transform {transform!r} needs a PRNG key (key=...).")
        batch, weights = get_transform(transform)(batch, key, **(transform_options or {}))
    output = get_scheme(scheme)(batch, **(options or {}))
    if weights is not None:
        combined = weights if output.row_weights is None else weights * output.row_weights
        output = output.replace(row_weights=combined)
    return batch, output


# ---------------------------------------------------------------------------
# Built-in schemes.
# ---------------------------------------------------------------------------


def _policy_mask(batch: Batch) -> chex.Array:
    return batch.loss_mask & batch.row_mask[:, None]


def _member_mask(batch: Batch) -> chex.Array:
    """`[N, G]` rows that are real rollouts (have a policy token)."""
    return batch.grouped(batch.row_mask & batch.loss_mask.any(axis=1))


def _adv_metrics(advantages, mask):
    count = jnp.maximum(mask.sum(), 1)
    return {
        "adv_mean": jnp.where(mask, advantages, 0.0).sum() / count,
        "adv_abs_mean": jnp.where(mask, jnp.abs(advantages), 0.0).sum() / count,
        "adv_zero_fraction": jnp.where(mask, advantages == 0, False).sum() / count,
    }


def _token_output(batch: Batch, advantages: chex.Array, returns=None) -> CreditOutput:
    mask = _policy_mask(batch)
    advantages = jnp.where(mask, advantages, 0.0)
    return CreditOutput(
        advantages=advantages, returns=returns, metrics=_adv_metrics(advantages, mask)
    )


@register_scheme(
    "grpo",
    loss_aggregation="seq_mean_token_mean",
    description="GRPO: group-normalised trajectory reward (SPEC §2).",
)
@register_scheme(
    "dr_grpo",
    options={"scale": "none"},
    loss_aggregation="seq_mean_token_sum_norm",
    description="Dr. GRPO: GRPO without the std division (SPEC §1-2).",
)
def grpo_scheme(batch: Batch, *, scale: str = "std", ddof: int = 1, eps: float = 1e-6):
    """GRPO on `Batch.outcome` (SPEC §2)."""
    advantages = grpo_advantages(
        batch.grouped(batch.outcome), scale=scale, ddof=ddof, eps=eps, mask=_member_mask(batch)
    )
    return _token_output(batch, trajectory_to_tokens(batch.ungrouped(advantages), batch.loss_mask))


@register_scheme(
    "mt_grpo",
    loss_aggregation="seq_mean_token_mean",
    description="MT-GRPO: turn-level group advantages (SPEC §3).",
)
def mt_grpo_scheme(batch: Batch, *, scale: str = "std", ddof: int = 1, eps: float = 1e-6):
    """MT-GRPO on `Batch.turn_rewards`, `turn_mask`, `outcome` (SPEC §3)."""
    batch.require("turn_rewards", scheme="mt_grpo")
    turn_mask = batch.turn_mask & batch.row_mask[:, None]
    advantages = mt_grpo_advantages(
        batch.grouped(batch.turn_rewards),
        batch.grouped(turn_mask),
        batch.grouped(batch.outcome),
        scale=scale,
        ddof=ddof,
        eps=eps,
    )
    return _token_output(
        batch, turns_to_tokens(batch.ungrouped(advantages), batch.turn_id, batch.loss_mask)
    )


def _final_rewards_on_tokens(batch: Batch) -> chex.Array:
    """`Batch.token_rewards` if set, else the outcome at the last policy token."""
    if batch.token_rewards is not None:
        return batch.token_rewards
    num_turns = batch.turn_mask.shape[1]
    return mt_ppo_token_rewards(
        batch.outcome,
        jnp.zeros((batch.batch_size, num_turns), batch.outcome.dtype),
        batch.turn_mask,
        batch.turn_id,
        batch.loss_mask,
    )


def _gae_output(batch, token_rewards, *, gamma, lambda_, whiten, scheme):
    batch.require("values", scheme=scheme)
    mask = _policy_mask(batch)
    advantages, returns = gae_advantages(
        token_rewards, batch.values, mask, gamma=gamma, lambda_=lambda_
    )
    if whiten:
        advantages = whiten_advantages(advantages, mask)
    return _token_output(batch, advantages, returns)


@register_scheme(
    "gae",
    needs_values="token",
    loss_aggregation="seq_mean_token_mean",
    description="PPO: token-level GAE over policy tokens (SPEC §4).",
)
def gae_scheme(
    batch: Batch, *, gamma: float = 1.0, lambda_: float = 0.95, whiten: bool = True
):
    """PPO GAE on `Batch.token_rewards` (or the outcome at the last token) (SPEC §4)."""
    return _gae_output(
        batch,
        _final_rewards_on_tokens(batch),
        gamma=gamma,
        lambda_=lambda_,
        whiten=whiten,
        scheme="gae",
    )


@register_scheme(
    "mt_ppo",
    needs_values="token",
    loss_aggregation="seq_mean_token_mean",
    description="MT-PPO: turn rewards at turn ends, GAE γ = λ = 1 (SPEC §4).",
)
def mt_ppo_scheme(
    batch: Batch, *, gamma: float = 1.0, lambda_: float = 1.0, whiten: bool = False
):
    """MT-PPO: `R^F` at the last policy token, `R^I_k` at turn ends, then GAE (SPEC §4)."""
    batch.require("turn_rewards", scheme="mt_ppo")
    token_rewards = mt_ppo_token_rewards(
        batch.outcome, batch.turn_rewards, batch.turn_mask, batch.turn_id, batch.loss_mask
    )
    return _gae_output(
        batch, token_rewards, gamma=gamma, lambda_=lambda_, whiten=whiten, scheme="mt_ppo"
    )


@register_scheme(
    "checklist", description="CM2 checklist rewards at trajectory/turn/step level (SPEC §5)."
)
def checklist_scheme(
    batch: Batch,
    *,
    level: str = "trajectory",
    scale: str = "none",
    ddof: int = 1,
    eps: float = 1e-6,
    turn_normalizer: str = "reached",
):
    """CM2 checklist credit (SPEC §5); `level` picks eq. 4, 6 or 9."""
    check_choice("level", level, ("trajectory", "turn", "step"))
    batch.require(
        "checklist_sat_after", "checklist_deps", "checklist_weights", "checklist_item_mask",
        "checklist_step_mask", scheme="checklist",
    )
    step_mask = batch.checklist_step_mask & batch.row_mask[:, None, None]
    credit = checklist_credit(
        batch.grouped(batch.checklist_sat_after),
        batch.grouped(batch.checklist_deps),
        batch.grouped(batch.checklist_weights),
        batch.grouped(step_mask),
        batch.grouped(batch.checklist_item_mask),
        batch.grouped(step_mask.any(axis=-1)),
        scale=scale,
        ddof=ddof,
        eps=eps,
        turn_normalizer=turn_normalizer,
        reference_turns=(
            None if batch.reference_turns is None else batch.grouped(batch.reference_turns)[:, 0]
        ),
    )
    if level == "trajectory":
        advantages = trajectory_to_tokens(batch.ungrouped(credit.traj_adv), batch.loss_mask)
    elif level == "turn":
        advantages = turns_to_tokens(
            batch.ungrouped(credit.turn_adv), batch.turn_id, batch.loss_mask
        )
    else:
        advantages = turn_steps_to_tokens(
            batch.ungrouped(credit.step_adv), batch.turn_id, batch.step_id, batch.loss_mask
        )
    output = _token_output(batch, advantages)
    traj_reward = batch.ungrouped(credit.traj_reward)
    return output.replace(
        metrics={**output.metrics, "checklist_reward": traj_reward.mean()}
    )


@register_scheme(
    "tree",
    loss_aggregation="seq_mean_token_mean",
    description="PORTool rewarded-tree step advantages (SPEC §6).",
)
def tree_scheme(
    batch: Batch,
    *,
    gamma: float = 0.95,
    fmt_bound: float = 0.25,
    rule: str = "portool",
    weighting: str = "theorem",
    scale: str = "std",
    ddof: int = 1,
    eps: float = 1e-6,
):
    """PORTool tree credit on `node_id`, `fmt_score`, `outcome` (SPEC §6)."""
    batch.require("node_id", "fmt_score", scheme="tree")
    num_steps = batch.step_mask.shape[1]
    step_mask = batch.step_mask & batch.row_mask[:, None]
    credit = tree_credit(
        batch.grouped(batch.node_id),
        batch.grouped(step_mask),
        batch.grouped(batch.outcome),
        batch.grouped(batch.fmt_score),
        batch.grouped(step_token_counts(batch.step_id, batch.loss_mask, num_steps)),
        gamma=gamma,
        fmt_bound=fmt_bound,
        rule=rule,
        weighting=weighting,
        scale=scale,
        ddof=ddof,
        eps=eps,
    )
    return _token_output(
        batch, steps_to_tokens(batch.ungrouped(credit.step_adv), batch.step_id, batch.loss_mask)
    )


@register_scheme(
    "segment",
    needs_values="boundary",
    loss_aggregation="segment_mean_sum",
    description="CARL: segment TD advantages from boundary values (SPEC §9).",
)
def segment_scheme(batch: Batch, *, gamma: float = 1.0, lambda_: float = 0.0):
    """CARL segment advantages from `Batch.boundary_values` (SPEC §9)."""
    batch.require("boundary_values", scheme="segment")
    seg_mask = batch.step_mask & batch.row_mask[:, None]
    advantages = segment_advantages(
        batch.boundary_values, seg_mask, batch.outcome, gamma=gamma, lambda_=lambda_
    )
    return _token_output(batch, steps_to_tokens(advantages, batch.step_id, batch.loss_mask))


@register_transform(
    "vspo", description="VSPO: refill zero-variance groups by value-based sampling (SPEC §8)."
)
def vspo_transform(
    batch: Batch,
    key: chex.PRNGKey,
    *,
    temperature: float = 0.1,
    alpha: float = 2.0,
    var_eps: float = 1e-6,
) -> tuple[Batch, chex.Array]:
    """Resamples whole groups of the batch by `vspo_resample` on `Batch.outcome`.

    Returns the batch with its groups gathered by `slot_to_group` and `[B]` row
    weights (each row of slot x carries `slot_weight[x]`).
    """
    slot_to_group, slot_weight = vspo_resample(
        batch.grouped(batch.outcome), key, temperature=temperature, alpha=alpha, var_eps=var_eps
    )

    def gather(x):
        if x is None:
            return None
        return batch.ungrouped(jnp.take(batch.grouped(x), slot_to_group, axis=0))

    resampled = jax.tree_util.tree_map(gather, batch)
    row_weights = jnp.repeat(slot_weight, batch.group_size)
    return resampled, row_weights
