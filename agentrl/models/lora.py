"""LoRA adapters on the Qwen projections: settings, merging, parameter split.

An adapted projection `W` (any of `q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj`) computes `x W + (α / r) · dropout(x) A B` with
`A [in, r]` (Kaiming-uniform) and `B [r, out]` (zeros), as PEFT does (Hu et
al. 2021, eq. 3). Parameters `lora_a` / `lora_b` sit next to the projection's
`kernel`. PORTool's setting is r = 16, α = 8 (seed App. C).

Adapters travel as PEFT directories (`save_peft_adapter` /
`load_peft_adapter`): `adapter_config.json` and `adapter_model.safetensors`
with PEFT's names and `[r, in]` / `[out, r]` matrices, which
`peft.PeftModel.from_pretrained` and vLLM's LoRA loader read.
"""

import json
import math
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl.models.config import QwenConfig
from agentrl.models.qwen import LORA_TARGETS, LoraSpec
from agentrl.models.weights import stack_layers, unstack_layers

PORTOOL_LORA = LoraSpec(rank=16, alpha=8.0, dropout=0.0, targets=LORA_TARGETS)


def lora_spec(rank: int, alpha: float, dropout: float = 0.0,
              targets: tuple[str, ...] = LORA_TARGETS) -> LoraSpec:
    """Validated LoRA settings."""
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not projections; choose from {LORA_TARGETS}.")
    if rank < 1:
        raise ValueError(f"LoRA rank={rank} must be >= 1.")
    return LoraSpec(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets))


def lora_delta(lora_a: jax.Array, lora_b: jax.Array, kernel_shape: tuple[int, ...],
               scale: float) -> jax.Array:
    """`scale · A B` reshaped like the kernel; leading (layer) axes are batched.

    With `lead` leading axes: `A [*lead, *in, r]`, `B [*lead, r, *out]`,
    `kernel [*lead, *in, *out]`, so `lead = A.ndim + B.ndim − kernel.ndim − 2`.
    """
    lead = lora_a.ndim + lora_b.ndim - len(kernel_shape) - 2
    rank = lora_a.shape[-1]
    a = lora_a.reshape(*lora_a.shape[:lead], -1, rank)
    b = lora_b.reshape(*lora_b.shape[:lead], rank, -1)
    return (scale * jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))).reshape(
        kernel_shape)


def _is_adapted(node: Any) -> bool:
    return isinstance(node, Mapping) and "lora_a" in node and "kernel" in node


def merge_lora(params: Mapping, spec: LoraSpec) -> dict:
    """Folds every adapter into its kernel (`W ← W + (α/r) A B`) and drops `lora_*`."""
    scale = spec.alpha / spec.rank

    def merge(node):
        if _is_adapted(node):
            kernel = node["kernel"]
            merged = kernel.astype(jnp.float32) + lora_delta(
                node["lora_a"], node["lora_b"], kernel.shape, scale)
            rest = {k: v for k, v in node.items() if k not in ("lora_a", "lora_b", "kernel")}
            return {"kernel": merged.astype(kernel.dtype), **rest}
        if isinstance(node, Mapping):
            return {k: merge(v) for k, v in node.items()}
        return node

    return merge(params)


def split_lora(params: Mapping) -> tuple[dict, dict]:
    """`(base, adapters)`: the frozen base tree and the trainable `lora_*` tree."""

    def split(node):
        if isinstance(node, Mapping):
            base, adapters = {}, {}
            for key, value in node.items():
                if key in ("lora_a", "lora_b"):
                    adapters[key] = value
                    continue
                b, a = split(value)
                base[key] = b
                if a:
                    adapters[key] = a
            return base, adapters
        return node, {}

    return split(params)


def join_lora(base: Mapping, adapters: Mapping) -> dict:
    """Inverse of `split_lora`."""
    out = dict(base)
    for key, value in adapters.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = join_lora(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------
# PEFT adapters (Hugging Face `peft`, vLLM's LoRA loader).
# ---------------------------------------------------------------------------

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's names: `base_model.model.` + the module path + `.lora_A.weight`; an
# adapter name (`lora_A.default.weight`) appears in some older files.
_PEFT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


def hf_module_name(layer: int, target: str) -> str:
    """The HF module of a projection: `model.layers.{layer}.self_attn.q_proj`, ..."""
    return f"model.layers.{layer}.{_PARENT[target]}.{target}"


def projection_shapes(config: QwenConfig, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(in_shape, out_shape)` of a projection's kernel in agentrl's layout."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    h, kv = config.num_attention_heads, config.num_key_value_heads
    shapes = {"q_proj": ((d,), (h, hd)), "k_proj": ((d,), (kv, hd)), "v_proj": ((d,), (kv, hd)),
              "o_proj": ((h, hd), (d,)), "gate_proj": ((d,), (f,)), "up_proj": ((d,), (f,)),
              "down_proj": ((f,), (d,))}
    return shapes[target]


def _stacked_adapters(params: Mapping, config: QwenConfig) -> Mapping:
    """The `lora_*` leaves of a full or adapter-only tree, stacked layout, on the host."""
    _, adapters = split_lora(params)
    if not adapters:
        raise KeyError(
            "the parameters hold no lora_a / lora_b leaves; pass the parameters of "
            "QwenModel(config, spec) with spec.rank > 0 (or split_lora's adapters)."
        )
    adapters = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), adapters)
    if "layers" not in adapters:
        adapters = stack_layers(adapters, config.num_hidden_layers)
    return adapters["layers"]["layer"]


def adapters_to_peft(params: Mapping, spec: LoraSpec, config: QwenConfig) -> dict[str, np.ndarray]:
    """agentrl adapters → PEFT state dict.

    Per layer, `lora_a [*in, r]` becomes `lora_A.weight [r, in]` and
    `lora_b [r, *out]` becomes `lora_B.weight [out, r]` (torch `Linear`
    weights are `[out, in]`), heads flattened as transformers does.

    Args:
      params: a parameter tree holding the `lora_*` leaves (the full tree or
        `split_lora`'s adapters; stacked or per-layer layout).
      spec: the LoRA settings; every target must have adapters.
      config: the model config.
    """
    layers = _stacked_adapters(params, config)
    tensors = {}
    for target in spec.targets:
        node = layers.get(_PARENT[target], {}).get(target)
        if not node or "lora_a" not in node or "lora_b" not in node:
            raise KeyError(
                f"LoRA target {target!r} of the spec has no lora_a/lora_b in the parameters; "
                "pass the parameters of QwenModel(config, spec) or drop the target from "
                "spec.targets."
            )
        lora_a, lora_b = node["lora_a"], node["lora_b"]
        if lora_a.shape[-1] != spec.rank:
            raise ValueError(
                f"LoRA {target}.lora_a has rank {lora_a.shape[-1]} but spec.rank={spec.rank}; "
                "pass the spec the adapters were created with."
            )
        for layer in range(config.num_hidden_layers):
            prefix = "base_model.model." + hf_module_name(layer, target)
            tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(
                lora_a[layer].reshape(-1, spec.rank).T)
            tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(
                lora_b[layer].reshape(spec.rank, -1).T)
    return tensors


def peft_adapter_config(spec: LoraSpec, base_model_name_or_path: str | None = None) -> dict:
    """The `adapter_config.json` dict PEFT and vLLM read."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": [t for t in LORA_TARGETS if t in spec.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
    }


def save_peft_adapter(
    directory: str | pathlib.Path,
    params: Mapping,
    spec: LoraSpec,
    config: QwenConfig,
    *,
    base_model_name_or_path: str | None = None,
    dtype: str | None = None,
) -> pathlib.Path:
    """Writes a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`).

    `peft.PeftModel.from_pretrained(base, directory)` and vLLM's LoRA loader
    read it; applied to the base checkpoint it computes what
    `QwenModel(config, spec)` does with these parameters.

    Args:
      directory: output directory (created).
      params: parameters holding the `lora_*` leaves (full tree or adapters).
      spec: LoRA settings (rank, α, dropout, targets).
      config: the model config.
      base_model_name_or_path: recorded in the config (PEFT loads that base
        when none is given).
      dtype: stored dtype (default: the adapters' own).

    Returns:
      The directory.
    """
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = adapters_to_peft(params, spec, config)
    if dtype is not None:
        tensors = {name: value.astype(jnp.dtype(dtype)) for name, value in tensors.items()}
    save_file(tensors, str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})
    adapter_config = peft_adapter_config(spec, base_model_name_or_path)
    (directory / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=2), encoding="utf-8")
    return directory


def _peft_spec(adapter_config: Mapping, targets: tuple[str, ...], path: pathlib.Path) -> LoraSpec:
    """LoRA settings of a PEFT config, refusing what `QwenModel` cannot compute."""
    unsupported = [
        ("peft_type", adapter_config.get("peft_type", "LORA") != "LORA", "a LoRA adapter"),
        ("use_dora", bool(adapter_config.get("use_dora")), "false (DoRA is not implemented)"),
        ("bias", adapter_config.get("bias", "none") != "none", '"none"'),
        ("lora_bias", bool(adapter_config.get("lora_bias")), "false"),
        ("fan_in_fan_out", bool(adapter_config.get("fan_in_fan_out")), "false"),
        ("modules_to_save", bool(adapter_config.get("modules_to_save")),
         "empty (only LoRA matrices are imported)"),
        ("rank_pattern", bool(adapter_config.get("rank_pattern")), "empty (one rank)"),
        ("alpha_pattern", bool(adapter_config.get("alpha_pattern")), "empty (one alpha)"),
    ]
    for field, bad, fix in unsupported:
        if bad:
            raise ValueError(
                f"{path / PEFT_CONFIG}: {field}={adapter_config.get(field)!r} is not supported; "
                f"agentrl imports adapters with {field} {fix}."
            )
    rank = int(adapter_config["r"])
    alpha = float(adapter_config.get("lora_alpha", 8))
    if adapter_config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # rsLoRA scales by α/√r = (α√r)/r
    return lora_spec(rank, alpha, float(adapter_config.get("lora_dropout") or 0.0), targets)


def read_peft_adapter(
    directory: str | pathlib.Path, config: QwenConfig
) -> tuple[LoraSpec, dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]]:
    """The LoRA settings and matrices of a PEFT adapter, in PEFT's layout.

    Returns:
      `(spec, {(layer, target): (A [r, in], B [out, r])})`; `spec.targets`
      are the projections that have matrices in any layer.
    """
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    config_file, weights_file = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no {PEFT_CONFIG} in {directory}; pass a PEFT adapter directory "
            "(PeftModel.save_pretrained layout)."
        )
    if not weights_file.is_file():
        raise FileNotFoundError(
            f"no {PEFT_WEIGHTS} in {directory}; re-save the adapter with "
            "PeftModel.save_pretrained(directory, safe_serialization=True)."
        )
    adapter_config = json.loads(config_file.read_text(encoding="utf-8"))
    matrices: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    unknown = []
    with safe_open(weights_file, framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118
            match = _PEFT_NAME.match(name)
            if not match or _PARENT.get(match[3]) != match[2]:
                unknown.append(name)
                continue
            layer, target, which = int(match[1]), match[3], match[4]
            matrices.setdefault((layer, target), {})[which] = f.get_tensor(name)
    if unknown:
        raise ValueError(
            f"{weights_file}: tensors {unknown[:5]} are not LoRA matrices of the decoder "
            f"projections {LORA_TARGETS}; agentrl imports only those."
        )
    targets = tuple(t for t in LORA_TARGETS if any(t == key[1] for key in matrices))
    spec = _peft_spec(adapter_config, targets, directory)
    out = {}
    for (layer, target), pair in sorted(matrices.items()):
        out[(layer, target)] = _checked_pair(pair, layer, target, spec.rank, config, weights_file)
    return spec, out


def _checked_pair(pair, layer, target, rank, config, weights_file):
    """`(A, B)` after checking both exist with the config's shapes."""
    name = f"layer {layer} {target}"
    if layer >= config.num_hidden_layers:
        raise ValueError(
            f"{weights_file}: {name} is beyond num_hidden_layers={config.num_hidden_layers}; "
            "is the config the adapter's base model?"
        )
    if set(pair) != {"A", "B"}:
        raise KeyError(f"{weights_file}: {name} lacks lora_{({'A', 'B'} - set(pair)).pop()}.")
    in_shape, out_shape = projection_shapes(config, target)
    expected = {"A": (rank, math.prod(in_shape)), "B": (math.prod(out_shape), rank)}
    for which, shape in expected.items():
        if pair[which].shape != shape:
            raise ValueError(
                f"{weights_file}: {name} lora_{which} has shape {pair[which].shape}, expected "
                f"{shape} (r={rank}); is the config the adapter's base model?"
            )
    return pair["A"], pair["B"]


def load_peft_adapter(directory: str | pathlib.Path, config: QwenConfig) -> tuple[LoraSpec, dict]:
    """Reads a PEFT LoRA adapter into agentrl's layout.

    Layers without matrices for a target (PEFT's `layers_to_transform`) get
    zeros, which leave the projection unchanged.

    Args:
      directory: the adapter (`adapter_config.json`, `adapter_model.safetensors`).
      config: the base model's config (`param_dtype` sets the dtype;
        `scan_layers` the layout).

    Returns:
      `(spec, adapters)`: `adapters` holds only `lora_a [L, *in, r]` /
      `lora_b [L, r, *out]` (numpy), ready for `join_lora(base, adapters)`.
    """
    spec, matrices = read_peft_adapter(directory, config)
    dtype = jnp.dtype(config.param_dtype)
    layer_tree: dict = {}
    for target in spec.targets:
        in_shape, out_shape = projection_shapes(config, target)
        lora_a = np.zeros((config.num_hidden_layers, *in_shape, spec.rank), dtype)
        lora_b = np.zeros((config.num_hidden_layers, spec.rank, *out_shape), dtype)
        for layer in range(config.num_hidden_layers):
            if (layer, target) in matrices:
                a, b = matrices[(layer, target)]
                lora_a[layer] = a.T.reshape(*in_shape, spec.rank).astype(dtype)
                lora_b[layer] = b.T.reshape(spec.rank, *out_shape).astype(dtype)
        layer_tree.setdefault(_PARENT[target], {})[target] = {"lora_a": lora_a, "lora_b": lora_b}
    adapters = {"layers": {"layer": layer_tree}}
    if not config.scan_layers:
        adapters = unstack_layers(adapters, config.num_hidden_layers)
    return spec, adapters
