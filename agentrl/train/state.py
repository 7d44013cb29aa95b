"""Train state: policy (and LoRA) params, value head or critic, optimizer channels, step, RNG.

Parameters live in one tree with up to three parts:

* `policy`: the Qwen policy (`QwenModel`, LoRA adapters inside when enabled);
* `value_head`: a value head on the policy's backbone (CARL's shared
  backbone; `PolicyValueModel`);
* `critic`: a separate critic (`ValueModel`: its own trunk and head; PPO).

Optimizer *channels* pair a loss with a parameter subset and an optimizer:
`actor` (the policy loss → `policy`), `critic` (the critic loss → `value_head`
or `critic`) and, with a shared backbone, `critic_backbone` (the critic loss →
`policy`, CARL's backbone learning rate). Each channel is an optax chain with
global-norm clipping, a warm-up schedule and AdamW (CARL: actor 1e-6, head
5e-6 with weight decay 0, backbone from the critic 5e-7 with 0.01).
"""

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from agentrl.models.config import QwenConfig
from agentrl.models.heads import make_head
from agentrl.models.qwen import LoraSpec, QwenModel, dtype_of

CHANNELS = ("actor", "critic", "critic_backbone")
NO_LORA = LoraSpec()
VALUE_MODES = ("none", "shared", "separate")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """One channel's optimizer: AdamW with warm-up and global-norm clipping.

    `decay_steps > 0` adds a cosine decay from `learning_rate` to
    `end_factor × learning_rate` over the `decay_steps` after the warm-up
    (the SFT stage uses it); 0 keeps the rate constant after the warm-up.
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 0
    end_factor: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def build(self) -> optax.GradientTransformation:
        if self.decay_steps > 0:
            schedule = optax.warmup_cosine_decay_schedule(
                0.0, self.learning_rate, self.warmup_steps,
                self.warmup_steps + self.decay_steps, self.learning_rate * self.end_factor)
        elif self.warmup_steps > 0:
            schedule = optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        else:
            schedule = optax.constant_schedule(self.learning_rate)
        parts = []
        if self.clip_norm is not None:
            parts.append(optax.clip_by_global_norm(self.clip_norm))
        parts.append(optax.adamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps,
                                 weight_decay=self.weight_decay))
        return optax.chain(*parts)


def lora_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Updates only `lora_a` / `lora_b` leaves; the base weights stay frozen."""

    def labels(params):
        def label(path, _):
            names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
            return "train" if names & {"lora_a", "lora_b"} else "freeze"

        return jax.tree_util.tree_map_with_path(label, params)

    return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the train state holds (static).

    Attributes:
      config: the policy's `QwenConfig`.
      lora: LoRA settings (rank 0: full fine-tuning).
      value: `"none"`, `"shared"` (value head on the policy backbone) or
        `"separate"` (a critic with its own trunk).
      head: `"linear"` or `"carl"`.
      critic_config: the separate critic's architecture (default: the policy's).
    """

    config: QwenConfig
    lora: LoraSpec = NO_LORA
    value: str = "none"
    head: str = "linear"
    critic_config: QwenConfig | None = None

    def __post_init__(self):
        if self.value not in VALUE_MODES:
            raise ValueError(f"ModelSpec.value={self.value!r} is not one of {VALUE_MODES}.")

    @property
    def policy(self) -> QwenModel:
        return QwenModel(self.config, self.lora)

    @property
    def critic_trunk(self) -> QwenModel:
        return QwenModel(self.critic_config or self.config)

    def value_head(self) -> nn.Module:
        config = (self.critic_config or self.config) if self.value == "separate" else self.config
        return make_head(self.head, dtype_of(config.param_dtype))

    def init(self, key: jax.Array) -> dict[str, Any]:
        """Boxed (`LogicallyPartitioned`) parameters of every part."""
        tokens = jnp.zeros((1, 1), jnp.int32)
        keys = jax.random.split(key, 3)
        params = {"policy": self.policy.init(keys[0], tokens)["params"]}
        if self.value == "shared":
            hidden = jnp.zeros((1, 1, self.config.hidden_size), dtype_of(self.config.dtype))
            params["value_head"] = self.value_head().init(keys[1], hidden)["params"]
        elif self.value == "separate":
            config = self.critic_config or self.config
            hidden = jnp.zeros((1, 1, config.hidden_size), dtype_of(config.dtype))
            params["critic"] = {
                "backbone": self.critic_trunk.init(keys[1], tokens)["params"],
                "value_head": self.value_head().init(keys[2], hidden)["params"],
            }
        return params


def channel_params(params: dict[str, Any], channel: str, value: str) -> Any:
    """The parameter subset a channel updates."""
    if channel == "actor":
        return params["policy"]
    if channel == "critic":
        return params["value_head"] if value == "shared" else params["critic"]
    return params["policy"]  # critic_backbone


def active_channels(spec: ModelSpec, optimizers: dict[str, OptimizerConfig]) -> tuple[str, ...]:
    names = ["actor"]
    if spec.value != "none":
        names.append("critic")
    if spec.value == "shared" and "critic_backbone" in optimizers:
        names.append("critic_backbone")
    return tuple(names)


def build_optimizers(spec: ModelSpec, optimizers: dict[str, OptimizerConfig]
                     ) -> dict[str, optax.GradientTransformation]:
    """One optax transformation per active channel (LoRA: policy channels train adapters only)."""
    unknown = sorted(set(optimizers) - set(CHANNELS))
    if unknown:
        raise ValueError(f"optimizer channels {unknown} are not among {CHANNELS}.")
    txs = {}
    for name in active_channels(spec, optimizers):
        if name not in optimizers:
            raise ValueError(
                f"the model needs an optimizer for channel {name!r} (value={spec.value!r}); "
                f"configure optimizers.{name}."
            )
        tx = optimizers[name].build()
        if spec.lora.rank > 0 and name in ("actor", "critic_backbone"):
            tx = lora_only(tx)
        txs[name] = tx
    return txs


@flax.struct.dataclass
class TrainState:
    """Everything the update step changes (donated to it).

    Attributes:
      step: optimizer steps taken.
      params: `{"policy", "value_head"?, "critic"?}`.
      opt_state: per-channel optax states.
      rng: PRNG key (mini-batch shuffles, dropout).
      skipped: updates skipped for non-finite loss or gradients.
    """

    step: jax.Array
    params: dict[str, Any]
    opt_state: dict[str, Any]
    rng: jax.Array
    skipped: jax.Array


def init_train_state(spec: ModelSpec, txs: dict[str, optax.GradientTransformation],
                     key: jax.Array, params: dict[str, Any] | None = None) -> TrainState:
    """A fresh state (random params unless `params` are given)."""
    init_key, rng = jax.random.split(key)
    if params is None:
        params = nn.meta.unbox(spec.init(init_key))
    opt_state = {name: tx.init(channel_params(params, name, spec.value))
                 for name, tx in txs.items()}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      rng=rng, skipped=jnp.zeros((), jnp.int32))
