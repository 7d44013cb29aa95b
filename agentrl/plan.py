"""`agentrl plan`: per-device memory of a training step, from shapes only.

    agentrl plan --model qwen2_5_7b --mesh data=1,fsdp=8,tensor=1 \\
        --device-memory-gb 80 --batch 8 --seq-len 4096 --dtype bfloat16 --remat full
    agentrl plan --hf-config /ckpt/Qwen2.5-7B-Instruct/config.json --mesh fsdp=8 ...
    agentrl plan --config configs/plan_qwen2_5_7b.py [--config.batch_size=16] [--json]

Nothing is allocated and no device of the planned mesh is needed: parameter
shapes come from `jax.eval_shape(model.init)`, the optimizer state from
`jax.eval_shape(optax.adamw(...).init)`, and shardings are built against a
`jax.sharding.AbstractMesh` with the model's logical-axis rules
(`agentrl.parallel.DEFAULT_RULES`, `fit_spec`: a mesh axis that does not divide
a dimension replicates it). So "Qwen2.5-7B on 8 × 80 GB" plans on a laptop.

Categories (bytes one device holds):

* parameters: every leaf's shard shape × the parameter dtype.
* optimizer state: AdamW's first and second moments (+ a step count), sharded
  like the parameters, in `optimizer_dtype` (float32 by default even for
  bfloat16 parameters: with β₂ = 0.999 an update changes the second moment by
  0.1 % per step, below bfloat16's resolution of 2⁻⁸ ≈ 0.4 %, so a bfloat16
  moment stalls). `master_weights=True` adds a float32 copy of bfloat16
  parameters.
* gradients: one gradient per parameter, in the parameter dtype, sharded like
  the parameters.
* activations: an estimate for one micro-batch (`ACTIVATIONS_DOC`).
* gathered weights: with FSDP (`fsdp > 1`) the weights of the layer in use are
  all-gathered and its weight gradient exists unsharded before its
  reduce-scatter.

The activation term is a model of what XLA keeps, not a measurement: XLA fuses
elementwise ops (fewer buffers) and its scheduler may overlap more (more).
Optimizer-update temporaries, XLA workspace and fragmentation are not counted.
Against XLA's buffer assignment of the real step (Qwen2.5-7B, fsdp=8, B=8,
T=4096, float32, compiled for 8 CPU devices) the estimate was within -10 % ..
+21 %. Use it to choose a mesh, batch and remat policy, then confirm on the
device (`benchmarks/gpu_check.py` prints both).
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from agentrl import parallel
from agentrl.models.config import DTYPES, PRESETS, REMAT_POLICIES, QwenConfig, model_config
from agentrl.models.policy import abstract_params
from agentrl.models.qwen import QwenModel

GIB = 1024**3
GB = 10**9
ATTENTION_IMPLS = ("xla", "cudnn")
# JAX preallocates this fraction of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_DEFAULT_MEMORY_FRACTION = 0.75

ACTIVATIONS_DOC = """\
Activation estimate for a micro-batch of B sequences of T tokens, per device
(B_d = B / (data·fsdp), heads and MLP widths divided by `tensor` where the
rules shard them; `a` = bytes of the compute dtype):

  activations = L · saved(remat) + working_layer + loss + inputs

* saved(remat), kept for every layer until its backward pass:
  - "full" (save nothing): the layer input [B_d, T, D] (the scan carry).
  - "dots_no_batch": the layer input and the outputs of the seven projections
    (q, k, v [B_d, T, heads·hd], o [B_d, T, D], gate, up [B_d, T, F], down).
  - "dots": as "dots_no_batch" plus the attention einsums (XLA attention: the
    float32 logits [B_d, heads, T, T] and the attention output).
  - "none": every intermediate of the layer, the set below.
* working_layer: one layer's full intermediate set, recomputed (remat) or
  being differentiated: input, two norm outputs, q, k, v and RoPE'd q, k,
  attention output, o, the mid-layer residual, gate, up, silu(gate)·up, down
  (each [B_d, T, ·]·a) and,
  for XLA attention, the float32 logits and the probabilities
  ([B_d, heads, T, T]·(4 + a)); cuDNN flash attention keeps only a float32
  log-sum-exp [B_d, heads, T] instead.
* loss: the chunked log-prob path (`token_logprobs_and_entropy`) holds, per
  chunk c = min(logits_chunk_size, T), three float32 [B_d, c, V/tensor] buffers
  (logits, log-softmax, their cotangent), plus the final hidden states and
  their cotangent (2 · [B_d, T, D]·a).
* inputs: the [B_d, 1, T, T] bool attention mask and the float32 RoPE tables
  (2 · [B_d, T, head_dim]).
"""


# ---------------------------------------------------------------------------
# Mesh.
# ---------------------------------------------------------------------------


def parse_mesh(text: str) -> parallel.MeshConfig:
    """`"data=1,fsdp=8,tensor=1"` → `MeshConfig`; omitted axes are 1, one may be -1."""
    sizes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in parallel.MESH_AXES:
            raise ValueError(
                f"--mesh {text!r}: {item!r} is not AXIS=SIZE with AXIS in {parallel.MESH_AXES}; "
                "write e.g. --mesh data=1,fsdp=8,tensor=1."
            )
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"--mesh {text!r}: size {value!r} of {name} is not an integer."
            ) from None
        if size < 1 and size != -1:
            raise ValueError(f"--mesh {text!r}: {name}={size}; sizes are ≥ 1 (or -1 for the rest).")
        sizes[name] = size
    return parallel.MeshConfig(**{axis: sizes.get(axis, 1) for axis in parallel.MESH_AXES})


def mesh_shape(mesh: parallel.MeshConfig | dict[str, int], num_devices: int | None = None
               ) -> dict[str, int]:
    """Axis sizes `{"data": ., "fsdp": ., "tensor": .}` checked against `num_devices`.

    Without `num_devices` the mesh defines the device count (no -1 allowed).
    """
    if isinstance(mesh, dict):
        unknown = set(mesh) - set(parallel.MESH_AXES)
        if unknown:
            raise ValueError(
                f"mesh {mesh}: unknown axes {sorted(unknown)}; use {parallel.MESH_AXES}."
            )
        mesh = parallel.MeshConfig(**{axis: int(mesh.get(axis, 1)) for axis in parallel.MESH_AXES})
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    if num_devices is None:
        if -1 in sizes:
            raise ValueError(
                f"mesh {dict(zip(parallel.MESH_AXES, sizes, strict=True))}: an axis of -1 needs "
                "the device count; pass --num-devices N (or give every axis a size)."
            )
        num_devices = math.prod(sizes)
    return dict(zip(parallel.MESH_AXES, mesh.shape(num_devices), strict=True))


def abstract_mesh(shape: dict[str, int]) -> AbstractMesh:
    """A device-free `(data, fsdp, tensor)` mesh of these sizes."""
    return AbstractMesh(tuple(shape[axis] for axis in parallel.MESH_AXES), parallel.MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(parallel.MESH_AXES))


# ---------------------------------------------------------------------------
# The plan.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one training step (see the module docstring).

    Attributes:
      model: the model's name (preset or config path).
      config: the `QwenConfig` planned (runtime fields included).
      param_count: parameters counted from `jax.eval_shape` of `init`.
      mesh: axis sizes.
      batch_size, seq_len: the micro-batch (global, all devices).
      batch_per_device: sequences each device processes.
      categories: `{name: bytes}` (parameters, optimizer_state, gradients,
        activations, gathered_weights; master_weights when kept).
      activation_terms: the activation estimate's parts `{name: bytes}`.
      device_memory_bytes: one device's memory.
      memory_fraction: the fraction of it the allocator may use.
    """

    model: str
    config: QwenConfig
    param_count: int
    mesh: dict[str, int]
    batch_size: int
    seq_len: int
    batch_per_device: int
    categories: dict[str, int]
    activation_terms: dict[str, int]
    optimizer_dtype: str
    device_memory_bytes: int
    memory_fraction: float

    @property
    def total_bytes(self) -> int:
        return sum(self.categories.values())

    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory_bytes * self.memory_fraction)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "model": self.model,
            "model_type": cfg.model_type,
            "param_count": self.param_count,
            "mesh": self.mesh,
            "num_devices": math.prod(self.mesh.values()),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "batch_per_device": self.batch_per_device,
            "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype,
            "optimizer_dtype": self.optimizer_dtype,
            "remat": cfg.remat,
            "attention_impl": cfg.attention_impl or "xla",
            "logits_chunk_size": cfg.logits_chunk_size,
            "bytes_per_device": dict(self.categories),
            "activation_terms": dict(self.activation_terms),
            "total_bytes": self.total_bytes,
            "device_memory_bytes": self.device_memory_bytes,
            "memory_fraction": self.memory_fraction,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
        }

    def table(self) -> str:
        """A human-readable table, GiB per device."""
        cfg = self.config
        devices = math.prod(self.mesh.values())
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [
            f"model      {self.model} ({cfg.model_type}, {self.param_count:,} parameters, "
            f"{cfg.num_hidden_layers} layers, d={cfg.hidden_size}, vocab={cfg.vocab_size})",
            f"mesh       {mesh} ({devices} devices)",
            f"batch      {self.batch_size} × {self.seq_len} tokens "
            f"({self.batch_per_device} × {self.seq_len} per device)",
            f"precision  params {cfg.param_dtype}, compute {cfg.dtype}, "
            f"AdamW moments {self.optimizer_dtype}",
            f"memory     remat={cfg.remat}, attention={cfg.attention_impl or 'xla'}, "
            f"logits chunk {cfg.logits_chunk_size}",
            "",
            f"{'per device':<44}{'GiB':>10}",
        ]
        labels = {
            "parameters": f"parameters ({cfg.param_dtype})",
            "master_weights": "master weights (float32)",
            "optimizer_state": f"optimizer state (AdamW, {self.optimizer_dtype})",
            "gradients": f"gradients ({cfg.param_dtype})",
            "activations": "activations (estimate)",
            "gathered_weights": "gathered weights (FSDP, transient)",
        }
        term_labels = {
            "saved_per_layer": f"  saved by remat={cfg.remat} × {cfg.num_hidden_layers} layers",
            "working_layer": "  one layer's working set",
            "loss": "  log-prob chunks + final hidden",
            "inputs": "  attention mask + RoPE tables",
        }
        for name, value in self.categories.items():
            lines.append(f"{labels[name]:<44}{value / GIB:>10.2f}")
            if name == "activations":
                for term, term_value in self.activation_terms.items():
                    lines.append(f"{term_labels[term]:<44}{term_value / GIB:>10.2f}")
        usable = (f"usable ({self.device_memory_bytes / GB:g} GB × {self.memory_fraction:g})")
        lines += [
            f"{'total':<44}{self.total_bytes / GIB:>10.2f}",
            f"{usable:<44}{self.usable_bytes / GIB:>10.2f}",
            f"fits       {'yes' if self.fits else 'NO'} "
            f"({100 * self.total_bytes / self.usable_bytes:.0f} % of usable memory)",
        ]
        return "\n".join(lines)


def _nbytes(shape: Sequence[int], dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _sharded_bytes(logical_axes, shape, dtype, mesh: AbstractMesh, rules) -> int:
    """Bytes one device holds of an array with these logical axes."""
    sharding = parallel.logical_sharding(logical_axes, shape, mesh, rules)
    return _nbytes(sharding.shard_shape(tuple(shape)), dtype)


def _check_batch(batch_size: int, mesh: AbstractMesh, rules) -> int:
    """Sequences per device; the batch must split evenly over its mesh axes."""
    spec = nn.logical_to_mesh_axes(("batch",), rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    ways = math.prod(dict(mesh.shape)[axis] for axis in axes)
    if batch_size < 1 or batch_size % ways:
        raise ValueError(
            f"batch_size={batch_size} does not split over the batch axes {axes} "
            f"({ways} ways); use a multiple of {ways} (or change the mesh)."
        )
    return batch_size // ways


def activation_terms(config: QwenConfig, batch_size: int, seq_len: int, mesh: AbstractMesh,
                     rules=parallel.DEFAULT_RULES) -> dict[str, int]:
    """The activation estimate, per device, by part (formula: `ACTIVATIONS_DOC`)."""
    B, T, D, F = batch_size, seq_len, config.hidden_size, config.intermediate_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    a = jnp.dtype(config.dtype)
    f32 = jnp.float32
    xla = (config.attention_impl or "xla") == "xla"

    def size(axes, shape, dtype=a):
        return _sharded_bytes(axes, shape, dtype, mesh, rules)

    embed = size(("batch", "length", "act_embed"), (B, T, D))
    q = size(("batch", "length", "act_heads", None), (B, T, heads, hd))
    k = size(("batch", "length", "act_kv_heads", None), (B, T, kv, hd))
    mlp = size(("batch", "length", "act_mlp"), (B, T, F))
    score_axes = ("batch", "act_heads", "length", None)
    logits = size(score_axes, (B, heads, T, T), f32) if xla else 0
    probs = size(score_axes, (B, heads, T, T)) if xla else 0
    lse = 0 if xla else size(("batch", "act_heads", "length"), (B, heads, T), f32)
    # [B, T, D]: input, two norm outputs, o, the mid-layer residual, down.
    # [B, T, heads·hd]: q, RoPE'd q, attention output; [B, T, kv·hd]: k, RoPE'd k, v.
    # [B, T, F]: gate, up, silu(gate)·up.
    everything = 6 * embed + 3 * q + 3 * k + 3 * mlp + logits + probs + lse
    projections = (q + 2 * k) + embed + 2 * mlp + embed  # q k v, o, gate up, down
    saved = {
        "full": embed,
        "dots_no_batch": embed + projections,
        "dots": embed + projections + logits + q,
        "none": everything,
    }[config.remat]
    chunk = min(config.logits_chunk_size, T)
    loss = (3 * size(("batch", "length", "act_vocab"), (B, chunk, config.vocab_size), f32)
            + 2 * embed)
    inputs = (size(("batch", None, "length", None), (B, 1, T, T), jnp.bool_)
              + 2 * size(("batch", "length", None), (B, T, hd), f32))
    return {
        "saved_per_layer": config.num_hidden_layers * saved,
        "working_layer": everything,
        "loss": loss,
        "inputs": inputs,
    }


def _gathered_weight_bytes(config, shapes, axes, mesh_sizes, rules) -> int:
    """FSDP transients: one layer's weights and weight gradient, and the (un)embedding."""
    if mesh_sizes["fsdp"] == 1:
        return 0
    no_fsdp = abstract_mesh({**mesh_sizes, "fsdp": 1})

    def full(leaf_shape, leaf_axes, drop_layers=False):
        if drop_layers:
            leaf_shape, leaf_axes = leaf_shape[1:], leaf_axes[1:]
        return _sharded_bytes(leaf_axes, leaf_shape, config.param_dtype, no_fsdp, rules)

    layer = sum(
        full(s.shape, names, drop_layers=True)
        for s, names in zip(jax.tree_util.tree_leaves(shapes["layers"]),
                            jax.tree_util.tree_leaves(axes["layers"],
                                                      is_leaf=lambda x: isinstance(x, tuple)),
                            strict=True)
    )
    embedding = full(shapes["embed_tokens"].shape, axes["embed_tokens"])
    if config.tie_word_embeddings:
        # The table is gathered once (lookup and LM head) plus its gradient accumulator.
        unembedding = 2 * embedding
    else:
        unembedding = 2 * full(shapes["lm_head"].shape, axes["lm_head"]) + embedding
    return 2 * layer + unembedding


def plan_memory(
    config: QwenConfig,
    mesh: parallel.MeshConfig | dict[str, int],
    *,
    batch_size: int,
    seq_len: int,
    device_memory_gb: float,
    num_devices: int | None = None,
    optimizer_dtype: str = "float32",
    master_weights: bool = False,
    memory_fraction: float = JAX_DEFAULT_MEMORY_FRACTION,
    rules=parallel.DEFAULT_RULES,
    name: str | None = None,
) -> MemoryPlan:
    """Per-device memory of a train step of `config` on `mesh` (shapes only, no allocation).

    Args:
      config: the model, with its runtime fields (`dtype`, `param_dtype`,
        `remat`, `attention_impl`, `logits_chunk_size`).
      mesh: `MeshConfig` or `{"data": ., "fsdp": ., "tensor": .}`.
      batch_size: sequences per micro-batch, all devices together.
      seq_len: tokens per sequence.
      device_memory_gb: memory of one device in GB (10⁹ bytes).
      num_devices: devices available; the mesh must use exactly these
        (default: the mesh's product).
      optimizer_dtype: dtype of AdamW's moments.
      master_weights: keep a float32 copy of non-float32 parameters.
      memory_fraction: the part of device memory the allocator may use
        (JAX's default preallocation is 0.75).
      rules: logical-axis rules.
      name: the model's name in the report.

    Returns:
      A `MemoryPlan`.
    """
    if optimizer_dtype not in DTYPES:
        raise ValueError(
            f"optimizer_dtype={optimizer_dtype!r} is not supported; use one of {DTYPES}."
        )
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be ≥ 1.")
    if device_memory_gb <= 0:
        raise ValueError(f"device_memory_gb={device_memory_gb} must be > 0 (e.g. 80 for an H100).")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1].")
    sizes = mesh_shape(mesh, num_devices)
    amesh = abstract_mesh(sizes)
    batch_per_device = _check_batch(batch_size, amesh, rules)

    # Parameter shapes do not depend on the attention kernel; XLA traces anywhere.
    boxed = abstract_params(QwenModel(config.replace(attention_impl=None)))
    shardings = parallel.tree_shardings(boxed, amesh, rules)
    shapes = nn.meta.unbox(boxed)
    axes = parallel.logical_axes_tree(boxed)
    count = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))
    param_bytes = parallel.bytes_per_device(shapes, shardings)

    moments_like = jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(optimizer_dtype)), shapes
    )
    optimizer = optax.adamw(1e-6, mu_dtype=jnp.dtype(optimizer_dtype))
    opt_state = jax.eval_shape(optimizer.init, moments_like)
    replicated = NamedSharding(amesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_state, shardings,
        transform_non_params=lambda _: replicated,
    )

    categories = {"parameters": param_bytes}
    if master_weights and jnp.dtype(config.param_dtype) != jnp.float32:
        master = jax.tree_util.tree_map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.float32), shapes
        )
        categories["master_weights"] = parallel.bytes_per_device(master, shardings)
    categories["optimizer_state"] = parallel.bytes_per_device(opt_state, opt_shardings)
    categories["gradients"] = param_bytes
    terms = activation_terms(config, batch_size, seq_len, amesh, rules)
    categories["activations"] = sum(terms.values())
    categories["gathered_weights"] = _gathered_weight_bytes(config, shapes, axes, sizes, rules)
    return MemoryPlan(
        model=name or "custom", config=config, param_count=count, mesh=sizes,
        batch_size=batch_size, seq_len=seq_len, batch_per_device=batch_per_device,
        categories=categories, activation_terms=terms, optimizer_dtype=optimizer_dtype,
        device_memory_bytes=int(device_memory_gb * GB), memory_fraction=memory_fraction,
    )


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------

CONFIG_FIELDS = ("model", "mesh", "batch_size", "seq_len", "dtype", "remat", "device_memory_gb")


def load_config_file(spec: str, overrides: Sequence[str] = ()):
    """`FILE.py[:arg]` → `get_config(arg)` (a locked `ConfigDict`); applies `--config.x=v`."""
    path_text, _, arg = spec.partition(":")
    path = pathlib.Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"--config {spec!r}: no file {path}; pass FILE.py[:arg].")
    module_spec = importlib.util.spec_from_file_location(f"agentrl_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"--config {spec!r}: {path} defines no get_config(arg).")
    config = module.get_config(arg) if arg else module.get_config()
    config.lock()
    for override in overrides:
        key, sep, value = override.removeprefix("--config.").partition("=")
        if not sep:
            raise ValueError(f"{override!r}: write overrides as --config.FIELD=VALUE.")
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        if leaf not in node:
            raise KeyError(f"{override!r}: the config has no field {key!r}; fields: "
                           f"{sorted(node.keys())}.")
        current = node[leaf]
        if isinstance(current, bool):
            parsed = value.lower() in ("1", "true", "yes")
        elif isinstance(current, (int, float)):
            parsed = type(current)(value)
        elif current is None and value.lower() == "none":
            parsed = None
        else:
            parsed = value
        node[leaf] = parsed
    missing = [field for field in CONFIG_FIELDS if field not in config]
    if missing:
        raise KeyError(f"--config {spec!r}: get_config() lacks fields {missing}; a plan config "
                       f"needs {CONFIG_FIELDS}.")
    return config


def resolve_model(model: str, **runtime) -> tuple[QwenConfig, str]:
    """A preset name or an HF `config.json` / checkpoint directory → `(QwenConfig, name)`."""
    if model in PRESETS:
        return model_config(model, **runtime), model
    path = pathlib.Path(model)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return QwenConfig.from_hf(path, **runtime), str(path)
    raise ValueError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor an HF "
                     "config.json path.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl plan",
        description="Per-device memory of a training step for a model and a mesh (shapes only).",
        epilog="exit status: 0 fits, 1 does not fit, 2 bad request.\n\n" + ACTIVATIONS_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"preset: {', '.join(sorted(PRESETS))}")
    source.add_argument("--hf-config", help="an HF config.json (or checkpoint directory)")
    parser.add_argument("--config", help="ml-collections FILE.py[:arg] with the plan fields "
                        f"{CONFIG_FIELDS}; --config.FIELD=VALUE overrides; flags win over it")
    parser.add_argument("--mesh", help="data=D,fsdp=F,tensor=T (omitted axes are 1)")
    parser.add_argument("--num-devices", type=int,
                        help="devices available (default: the mesh's product)")
    parser.add_argument("--device-memory-gb", type=float, help="memory of one device, GB")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="usable fraction of device memory (default 0.75, JAX's "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION default)")
    parser.add_argument("--batch", type=int, help="sequences per micro-batch (all devices)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--dtype", choices=DTYPES, help="parameter and compute dtype")
    parser.add_argument("--param-dtype", choices=DTYPES,
                        help="parameter storage dtype (default: --dtype)")
    parser.add_argument("--optimizer-dtype", choices=DTYPES, default="float32",
                        help="AdamW moment dtype (default float32)")
    parser.add_argument("--master-weights", action="store_true",
                        help="count a float32 master copy of non-float32 parameters")
    parser.add_argument("--remat", choices=REMAT_POLICIES, help="per-layer remat policy")
    parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, help="default xla")
    parser.add_argument("--logits-chunk-size", type=int, help="log-prob chunk (default 512)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _settings(args, overrides) -> dict[str, Any]:
    """Merge the config file (if any) and the flags; flags win."""
    settings = {"model": None, "mesh": None, "batch_size": None, "seq_len": None,
                "dtype": "bfloat16", "remat": "full", "device_memory_gb": None,
                "num_devices": None, "param_dtype": None, "attention_impl": None,
                "logits_chunk_size": None, "memory_fraction": JAX_DEFAULT_MEMORY_FRACTION}
    if args.config:
        config = load_config_file(args.config, overrides)
        for field in settings:
            if field in config:
                value = config[field]
                settings[field] = value.to_dict() if hasattr(value, "to_dict") else value
    elif overrides:
        raise ValueError(f"{overrides[0]!r}: --config.FIELD overrides need --config FILE.py.")
    flags = {
        "model": args.model or args.hf_config, "mesh": args.mesh, "batch_size": args.batch,
        "seq_len": args.seq_len, "dtype": args.dtype, "remat": args.remat,
        "device_memory_gb": args.device_memory_gb, "num_devices": args.num_devices,
        "param_dtype": args.param_dtype, "attention_impl": args.attention_impl,
        "logits_chunk_size": args.logits_chunk_size, "memory_fraction": args.memory_fraction,
    }
    settings.update({k: v for k, v in flags.items() if v is not None})
    flag_names = {"model": "--model/--hf-config", "mesh": "--mesh", "batch_size": "--batch",
                  "seq_len": "--seq-len", "device_memory_gb": "--device-memory-gb"}
    missing = [flag for field, flag in flag_names.items() if settings[field] is None]
    if missing:
        raise ValueError(f"agentrl plan needs {', '.join(missing)} (as flags or --config fields).")
    return settings


def main(argv: list[str] | None = None) -> int:
    """`agentrl plan ...`; exit status 0 if it fits, 1 if not, 2 on a bad request."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    args = build_parser().parse_args([a for a in argv if not a.startswith("--config.")])
    try:
        settings = _settings(args, overrides)
        mesh = settings["mesh"]
        mesh = parse_mesh(mesh) if isinstance(mesh, str) else mesh
        attention = settings["attention_impl"]
        runtime = {
            "dtype": settings["dtype"],
            "param_dtype": settings["param_dtype"] or settings["dtype"],
            "remat": settings["remat"],
            "attention_impl": None if attention in (None, "xla") else attention,
        }
        if settings["logits_chunk_size"]:
            runtime["logits_chunk_size"] = int(settings["logits_chunk_size"])
        config, name = resolve_model(settings["model"], **runtime)
        plan = plan_memory(
            config, mesh, batch_size=int(settings["batch_size"]),
            seq_len=int(settings["seq_len"]),
            device_memory_gb=float(settings["device_memory_gb"]),
            num_devices=settings["num_devices"], optimizer_dtype=args.optimizer_dtype,
            master_weights=args.master_weights,
            memory_fraction=float(settings["memory_fraction"]), name=name,
        )
    except (ValueError, KeyError, FileNotFoundError, AttributeError, NotImplementedError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"agentrl plan: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
