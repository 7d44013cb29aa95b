"""`Policy`: a Qwen model, its (sharded) parameters, and jitted entry points.

    policy = load_pretrained("/ckpt/Qwen2.5-7B-Instruct", dtype="bfloat16", mesh=mesh)
    logits = policy.logits(tokens, attention_mask)          # [B, T, V]
    logp, entropy = policy.token_logprobs(tokens, attention_mask)
    policy.save_pretrained("/ckpt/out")                      # transformers / vLLM loadable
"""

import functools
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentrl import parallel
from agentrl.models import weights
from agentrl.models.config import QwenConfig
from agentrl.models.qwen import LoraSpec, QwenModel, token_logprobs_and_entropy

NO_LORA = LoraSpec()


def abstract_params(model: QwenModel) -> Any:
    """`jax.eval_shape` of `model.init`: boxed (`LogicallyPartitioned`) shapes, no allocation."""
    return jax.eval_shape(
        lambda key: model.init(key, jnp.zeros((1, 1), jnp.int32)), jax.random.key(0)
    )["params"]


def param_shardings(model: QwenModel, mesh: jax.sharding.Mesh, rules=parallel.DEFAULT_RULES):
    """`(shardings, shapes)` of the model's parameters (unboxed trees)."""
    boxed = abstract_params(model)
    return parallel.tree_shardings(boxed, mesh, rules), nn.meta.unbox(boxed)


class Policy:
    """A Qwen causal LM with parameters placed on a mesh.

    Attributes:
      config: the `QwenConfig`.
      params: parameter tree (`jax.Array`s, sharded over `mesh`).
      mesh: the device mesh (a 1-device mesh by default).
      rules: logical-axis rules.
      model: the Flax module.
    """

    def __init__(self, config: QwenConfig, params: Any, mesh=None, rules=parallel.DEFAULT_RULES,
                 lora: LoraSpec = NO_LORA):
        self.config = config
        self.params = params
        self.mesh = mesh if mesh is not None else parallel.make_mesh(devices=jax.devices()[:1])
        self.rules = rules
        self.model = QwenModel(config, lora)

    # -- construction ------------------------------------------------------

    @classmethod
    def init(cls, config: QwenConfig, key: jax.Array | int = 0, *, mesh=None,
             rules=parallel.DEFAULT_RULES, lora: LoraSpec = NO_LORA) -> "Policy":
        """Random parameters, created directly sharded (`jit` with `out_shardings`)."""
        mesh = mesh if mesh is not None else parallel.make_mesh(devices=jax.devices()[:1])
        model = QwenModel(config, lora)
        shardings, _ = param_shardings(model, mesh, rules)
        key = jax.random.key(key) if isinstance(key, int) else key
        tokens = jnp.zeros((1, 1), jnp.int32)

        @functools.partial(jax.jit, out_shardings=shardings)
        def init_fn(key):
            return nn.meta.unbox(model.init(key, tokens)["params"])

        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            params = init_fn(key)
        return cls(config, params, mesh, rules, lora)

    # -- forward -----------------------------------------------------------

    def _context(self):
        return parallel.mesh_and_rules(self.mesh, self.rules)

    @functools.cached_property
    def _forward(self):
        def forward(params, tokens, segment_ids, positions):
            out = self.model.apply({"params": params}, tokens, positions, segment_ids)
            return out["hidden"]

        return jax.jit(forward)

    @functools.cached_property
    def _logits(self):
        def logits(params, tokens, segment_ids, positions):
            hidden = self.model.apply({"params": params}, tokens, positions, segment_ids)["hidden"]
            return self.model.apply({"params": params}, hidden, method=QwenModel.logits)

        return jax.jit(logits)

    @functools.cached_property
    def _token_logprobs(self):
        def token_logprobs(params, tokens, segment_ids, positions):
            hidden = self.model.apply({"params": params}, tokens, positions, segment_ids)["hidden"]
            unembed = self.model.apply({"params": params}, method=QwenModel.unembedding)
            return token_logprobs_and_entropy(
                hidden[:, :-1], tokens[:, 1:], unembed, chunk_size=self.config.logits_chunk_size
            )

        return jax.jit(token_logprobs)

    def _inputs(self, tokens, attention_mask, positions):
        tokens = jnp.asarray(tokens, jnp.int32)
        segment_ids = (jnp.ones_like(tokens) if attention_mask is None
                       else jnp.asarray(attention_mask, jnp.int32))
        if positions is not None:
            positions = jnp.asarray(positions, jnp.int32)
        return tokens, segment_ids, positions

    def logits(self, tokens, attention_mask=None, positions=None) -> jax.Array:
        """`[B, T, V]` float32 logits.

        Args:
          tokens: `[B, T]` int.
          attention_mask: `[B, T]`, 1 on real tokens, 0 on padding (or segment
            ids for packed rows); default all ones.
          positions: `[B, T]` RoPE positions; default 0-based per segment.
        """
        with self._context():
            return self._logits(self.params, *self._inputs(tokens, attention_mask, positions))

    def hidden(self, tokens, attention_mask=None, positions=None) -> jax.Array:
        """`[B, T, D]` final hidden states (after the final norm)."""
        with self._context():
            return self._forward(self.params, *self._inputs(tokens, attention_mask, positions))

    def token_logprobs(self, tokens, attention_mask=None, positions=None):
        """`(logp [B, T-1], entropy [B, T-1])` of `tokens[:, 1:]`, chunked over the sequence."""
        with self._context():
            return self._token_logprobs(
                self.params, *self._inputs(tokens, attention_mask, positions)
            )

    # -- export ------------------------------------------------------------

    def save_pretrained(self, path: str | pathlib.Path, *, dtype: str | None = None,
                        max_shard_bytes: int = 5 * 1024**3) -> pathlib.Path:
        """Writes an HF checkpoint directory that `transformers` and vLLM load."""
        params = self.params
        if self.model.lora.rank > 0:
            from agentrl.models.lora import merge_lora

            params = merge_lora(params, self.model.lora)
        params = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), params)
        if not self.config.scan_layers:
            params = weights.stack_layers(params, self.config.num_hidden_layers)
        return weights.save_hf_checkpoint(path, params, self.config, dtype=dtype,
                                          max_shard_bytes=max_shard_bytes)


def load_pretrained(
    path: str | pathlib.Path,
    *,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules=parallel.DEFAULT_RULES,
    **runtime,
) -> Policy:
    """Loads an HF checkpoint directory straight into sharded arrays.

    Args:
      path: directory with `config.json` and `model.safetensors` (or a sharded
        set with `model.safetensors.index.json`).
      dtype: parameter and compute dtype (`"float32"` or `"bfloat16"`).
      mesh: device mesh (default: one device).
      rules: logical-axis rules.
      **runtime: other `QwenConfig` runtime options (`remat`, `scan_layers`,
        `attention_impl`, ...).

    Returns:
      A `Policy`.
    """
    runtime = {"dtype": dtype, "param_dtype": dtype, **runtime}
    config = QwenConfig.from_hf(path, **runtime)
    mesh = mesh if mesh is not None else parallel.make_mesh(devices=jax.devices()[:1])
    stacked = config.replace(scan_layers=True)
    shardings, shapes = param_shardings(QwenModel(stacked), mesh, rules)
    params = weights.load_sharded_params(path, stacked, shardings, shapes)
    if not config.scan_layers:
        params = weights.unstack_layers(params, config.num_hidden_layers)
    return Policy(config, params, mesh, rules)
