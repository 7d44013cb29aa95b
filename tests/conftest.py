"""Test-wide setup: 8 simulated CPU devices and strict rank promotion.

XLA_FLAGS must be set before jax is first imported, so this module sets it at
import time (pytest imports conftest.py before any test module).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
