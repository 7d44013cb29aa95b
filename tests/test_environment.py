"""tests/conftest.py's promises: 8 simulated CPU devices, strict rank promotion."""

import jax
import jax.numpy as jnp
import pytest


def test_eight_simulated_devices():
    assert jax.device_count() == 8


def test_implicit_rank_promotion_raises():
    with pytest.raises(ValueError, match="rank_promotion"):
        jnp.ones((3,)) + jnp.ones((2, 3))
