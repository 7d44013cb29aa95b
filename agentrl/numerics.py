"""Shared numerics: masked means and group normalisation (SPEC §1).

Every group-normalising function of `agentrl.credit` takes the same three knobs
(SPEC §1, "Group normalisation"):

* `scale="std"`: divide by `std(x, ddof) + eps`; `scale="none"`: divide by 1
  (Dr. GRPO; CM2 App. A.3 "standard deviation term set to 1").
* `ddof=1` by default (unbiased, as verl and TRL do).
* A set with at most `ddof` members has no spread: its normalised values are 0.
"""

from typing import Literal

import chex
import jax.numpy as jnp

Scale = Literal["std", "none"]
SCALES = ("std", "none")


def check_scale(scale: str) -> None:
    """Raises a ValueError naming the bad `scale` and the accepted values."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not supported; use one of {SCALES}.")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises a ValueError naming the option, its bad value and the accepted values."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {choices}.")


def float_dtype(*arrays) -> jnp.dtype:
    """The floating dtype results are computed in (float32, or float64 under x64)."""
    return jnp.result_type(float, *[jnp.asarray(a).dtype for a in arrays])


def masked_mean(x: chex.Array, mask: chex.Array, axis, keepdims: bool = False) -> chex.Array:
    """Mean of `x` over `axis` where `mask`; 0 for an empty set."""
    weights = mask.astype(x.dtype)
    count = weights.sum(axis=axis, keepdims=keepdims)
    total = (x * weights).sum(axis=axis, keepdims=keepdims)
    return total / jnp.maximum(count, 1)


def group_statistics(
    x: chex.Array,
    mask: chex.Array,
    *,
    axis: int,
    scale: Scale = "std",
    ddof: int = 1,
    eps: float = 1e-6,
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """Masked group mean, scale and spread flag along `axis` (SPEC §1).

    Args:
      x: values, any shape; float.
      mask: same shape as `x`; bool, the members that take part.
      axis: the group axis (G).
      scale: `"std"` (`std(x, ddof) + eps`) or `"none"` (1).
      ddof: delta degrees of freedom of the standard deviation.
      eps: added to the standard deviation.

    Returns:
      `(mean, denominator, has_spread)`, each with `axis` kept at size 1;
      `has_spread` is False for groups with at most `ddof` valid members.
    """
    check_scale(scale)
    chex.assert_equal_shape([x, mask])
    mask = mask.astype(bool)
    weights = mask.astype(x.dtype)
    count = weights.sum(axis=axis, keepdims=True)
    # Shifted-data mean: subtract one member's value first, so a group of equal
    # values has a mean equal to that value bit for bit (its advantages are
    # exactly 0 instead of rounding noise divided by eps).
    first = jnp.argmax(mask, axis=axis, keepdims=True)
    shift = jnp.take_along_axis(jnp.where(mask, x, 0.0), first, axis=axis)
    shifted = jnp.where(mask, x - shift, 0.0)
    mean = shift + shifted.sum(axis=axis, keepdims=True) / jnp.maximum(count, 1)
    if scale == "std":
        centred = jnp.where(mask, x - mean, 0.0)
        var = (centred**2).sum(axis=axis, keepdims=True) / jnp.maximum(count - ddof, 1)
        denominator = jnp.sqrt(var) + eps
    else:
        denominator = jnp.ones_like(mean)
    return mean, denominator, count > ddof


def group_normalize(
    x: chex.Array,
    mask: chex.Array,
    *,
    axis: int,
    scale: Scale = "std",
    ddof: int = 1,
    eps: float = 1e-6,
) -> chex.Array:
    """Masked group z-score `(x − mean_g x) / scale_g(x)` along `axis` (SPEC §1).

    `scale_g(x) = std(x, ddof) + eps` for `scale="std"` and 1 for `"none"`.
    Members with `mask = 0` are neither counted nor scored; their output is 0.
    A group with at most `ddof` valid members has no spread: its outputs are 0.

    Args:
      x: values, any shape; float.
      mask: same shape as `x`; bool, the members that take part.
      axis: the group axis (G).
      scale, ddof, eps: as in `group_statistics`.

    Returns:
      Same shape as `x`.
    """
    mean, denominator, has_spread = group_statistics(
        x, mask, axis=axis, scale=scale, ddof=ddof, eps=eps
    )
    return jnp.where(mask & has_spread, (x - mean) / denominator, 0.0)
