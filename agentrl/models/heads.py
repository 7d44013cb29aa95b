"""Value heads: PPO's linear head and CARL's 2-layer MLP head.

* `LinearValueHead`: `V(h) = h · w + b` (PPO critic; MT-PPO seed §4).
* `CarlValueHead`: `V(h) = σ(W₂ GELU(W₁ h + b₁) + b₂)` with `W₁ [D, D]`, the
  final layer zero-initialised so `V = 0.5` at the start (CARL seed App. B,
  SPEC §9.3).

Either head sits on a shared backbone (`PolicyValueModel`: one Qwen trunk, the
LM head and the value head; CARL) or on a separate critic backbone
(`ValueModel`: its own Qwen trunk; PPO).
"""

from typing import Any, Literal

import flax.linen as nn
import jax.numpy as jnp

from agentrl.models.config import QwenConfig
from agentrl.models.qwen import LoraSpec, QwenModel, dtype_of, lift

HeadKind = Literal["linear", "carl"]


class LinearValueHead(nn.Module):
    """`[..., D]` → `[...]` float32 values, `h · w + b`."""

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden):
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None)),
            (hidden.shape[-1], 1), self.param_dtype,
        )
        bias = self.param("bias", nn.initializers.zeros_init(), (1,), self.param_dtype)
        out = jnp.einsum("...d,do->...o", hidden.astype(jnp.float32), kernel.astype(jnp.float32))
        return (out + lift(bias.astype(jnp.float32), out.ndim))[..., 0]


class CarlValueHead(nn.Module):
    """`[..., D]` → `[...]` values in (0, 1): `σ(W₂ GELU(W₁ h + b₁) + b₂)`, W₂ = 0 at init."""

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden):
        d = hidden.shape[-1]
        w1 = self.param(
            "hidden_kernel",
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
            (d, d), self.param_dtype,
        )
        b1 = self.param("hidden_bias", nn.with_logical_partitioning(
            nn.initializers.zeros_init(), ("mlp",)), (d,), self.param_dtype)
        w2 = self.param(
            "output_kernel",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp", None)),
            (d, 1), self.param_dtype,
        )
        b2 = self.param("output_bias", nn.initializers.zeros_init(), (1,), self.param_dtype)
        x = hidden.astype(jnp.float32)
        x = nn.gelu(x @ w1.astype(jnp.float32) + lift(b1.astype(jnp.float32), x.ndim))
        out = x @ w2.astype(jnp.float32)
        return nn.sigmoid(out + lift(b2.astype(jnp.float32), out.ndim))[..., 0]


def make_head(kind: HeadKind, param_dtype) -> nn.Module:
    if kind == "linear":
        return LinearValueHead(param_dtype, name="value_head")
    if kind == "carl":
        return CarlValueHead(param_dtype, name="value_head")
    raise ValueError(f"value head kind={kind!r} is not supported; use 'linear' or 'carl'.")


class PolicyValueModel(nn.Module):
    """Shared backbone: one Qwen trunk feeding the LM head and a value head (CARL).

    `__call__` returns `{"hidden": [B, T, D], "values": [B, T]}`; logits or
    log-probabilities come from `QwenModel.logits` / `unembedding` on
    `hidden` (`method=` on the `backbone` submodule's params).
    """

    config: QwenConfig
    head: HeadKind = "carl"
    lora: LoraSpec = LoraSpec()

    def setup(self):
        self.backbone = QwenModel(self.config, self.lora)
        self.value_head = make_head(self.head, dtype_of(self.config.param_dtype))

    def __call__(self, tokens, positions=None, segment_ids=None):
        hidden = self.backbone(tokens, positions, segment_ids)["hidden"]
        return {"hidden": hidden, "values": self.value_head(hidden)}

    def logits(self, hidden):
        return self.backbone.logits(hidden)

    def unembedding(self):
        return self.backbone.unembedding()


class ValueModel(nn.Module):
    """A separate critic: its own Qwen trunk and a value head (PPO).

    `__call__` returns values `[B, T]` at every position.
    """

    config: QwenConfig
    head: HeadKind = "linear"

    def setup(self):
        self.backbone = QwenModel(self.config)
        self.value_head = make_head(self.head, dtype_of(self.config.param_dtype))

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.value_head(self.backbone(tokens, positions, segment_ids)["hidden"])
