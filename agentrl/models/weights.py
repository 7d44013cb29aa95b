"""Hugging Face safetensors ⇄ agentrl parameters.

Layout. agentrl keeps the decoder layers stacked on a leading `layers` axis
(`params["layers"]["layer"][...]`, one array per projection for all layers,
as `nn.scan` wants); projection kernels are `[in, out]` with heads split out
(`q_proj.kernel [D, H, head_dim]`), where `transformers` stores
`[out, in]` matrices per layer (`model.layers.{i}.self_attn.q_proj.weight
[H·head_dim, D]`). `LAYER_TENSORS` and `GLOBAL_TENSORS` are the whole mapping.

Loading never builds the whole model on one device: each parameter is created
with `jax.make_array_from_callback`, whose callback reads, for one device's
shard, the HF tensors it needs from the memory-mapped safetensors files.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from agentrl.models.config import QwenConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def progress(items: Iterable, *, total: int | None = None, desc: str = "",
             enabled: bool = True) -> Iterable:
    """`items`, with a progress bar on stderr when `enabled`.

    Uses tqdm when it is installed (it comes with transformers); otherwise
    prints one line per tenth of the work.
    """
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _plain_progress(items, total, desc)
    return tqdm(items, total=total, desc=desc, unit="tensor", leave=False)


def _plain_progress(items: Iterable, total: int | None, desc: str) -> Iterator:
    import sys

    step = max(1, (total or 0) // 10)
    for done, item in enumerate(items, start=1):
        yield item
        if done % step == 0 or done == total:
            print(f"{desc}: {done}/{total if total is not None else '?'}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor ⇄ one agentrl parameter (per layer for layer tensors).

    Attributes:
      hf_name: HF name (`{i}` is the layer index for layer tensors).
      path: the parameter's path in the agentrl tree (below `layers/layer`
        for layer tensors).
      to_params: HF array → agentrl array (per layer).
      to_hf: agentrl array → HF array (per layer).
      when: whether the tensor exists for a config.
    """

    hf_name: str
    path: tuple[str, ...]
    to_params: Callable[[np.ndarray, QwenConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, QwenConfig], np.ndarray]
    when: Callable[[QwenConfig], bool] = lambda config: True


def _identity(x, config):
    return x


def _transpose(x, config):
    return x.T


def _split_out(heads_of: Callable[[QwenConfig], int]):
    """`[heads·hd, D]` (HF) → `[D, heads, hd]` and back."""

    def to_params(x, config):
        return x.T.reshape(config.hidden_size, heads_of(config), config.head_dim)

    def to_hf(x, config):
        return x.reshape(config.hidden_size, -1).T

    return to_params, to_hf


def _split_bias(heads_of):
    def to_params(x, config):
        return x.reshape(heads_of(config), config.head_dim)

    def to_hf(x, config):
        return x.reshape(-1)

    return to_params, to_hf


def _o_proj_to_params(x, config):
    return x.T.reshape(config.num_attention_heads, config.head_dim, config.hidden_size)


def _o_proj_to_hf(x, config):
    return x.reshape(-1, config.hidden_size).T


def _q_heads(config):
    return config.num_attention_heads


def _kv_heads(config):
    return config.num_key_value_heads


def _has_bias(config):
    return config.attention_bias


def _has_qk_norm(config):
    return config.qk_norm


def _untied(config):
    return not config.tie_word_embeddings


_PREFIX = "model.layers.{i}."
LAYER_TENSORS: tuple[TensorMap, ...] = (
    TensorMap(_PREFIX + "input_layernorm.weight", ("input_layernorm", "scale"), _identity,
              _identity),
    TensorMap(_PREFIX + "post_attention_layernorm.weight", ("post_attention_layernorm", "scale"),
              _identity, _identity),
    TensorMap(_PREFIX + "self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"),
              *_split_out(_q_heads)),
    TensorMap(_PREFIX + "self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"),
              *_split_out(_kv_heads)),
    TensorMap(_PREFIX + "self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"),
              *_split_out(_kv_heads)),
    TensorMap(_PREFIX + "self_attn.q_proj.bias", ("self_attn", "q_proj", "bias"),
              *_split_bias(_q_heads), when=_has_bias),
    TensorMap(_PREFIX + "self_attn.k_proj.bias", ("self_attn", "k_proj", "bias"),
              *_split_bias(_kv_heads), when=_has_bias),
    TensorMap(_PREFIX + "self_attn.v_proj.bias", ("self_attn", "v_proj", "bias"),
              *_split_bias(_kv_heads), when=_has_bias),
    TensorMap(_PREFIX + "self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"),
              _o_proj_to_params, _o_proj_to_hf),
    TensorMap(_PREFIX + "self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), _identity,
              _identity, when=_has_qk_norm),
    TensorMap(_PREFIX + "self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), _identity,
              _identity, when=_has_qk_norm),
    TensorMap(_PREFIX + "mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), _transpose,
              _transpose),
    TensorMap(_PREFIX + "mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), _transpose,
              _transpose),
    TensorMap(_PREFIX + "mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), _transpose,
              _transpose),
)
GLOBAL_TENSORS: tuple[TensorMap, ...] = (
    TensorMap("model.embed_tokens.weight", ("embed_tokens",), _identity, _identity),
    TensorMap("model.norm.weight", ("norm", "scale"), _identity, _identity),
    TensorMap("lm_head.weight", ("lm_head",), _transpose, _transpose, when=_untied),
)
LAYER_ROOT = ("layers", "layer")


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def param_paths(config: QwenConfig) -> Iterator[tuple[tuple[str, ...], TensorMap, bool]]:
    """`(path, mapping, is_layer)` of every parameter the config has (stacked layout)."""
    for mapping in GLOBAL_TENSORS:
        if mapping.when(config):
            yield mapping.path, mapping, False
    for mapping in LAYER_TENSORS:
        if mapping.when(config):
            yield LAYER_ROOT + mapping.path, mapping, True


def hf_tensor_names(config: QwenConfig) -> list[str]:
    """Every HF tensor name a checkpoint of this config holds (all layers)."""
    names = []
    for _, mapping, is_layer in param_paths(config):
        layers = range(config.num_hidden_layers) if is_layer else [None]
        names += [mapping.hf_name.format(i=i) for i in layers]
    return names


# ---------------------------------------------------------------------------
# In-memory conversion (numpy).
# ---------------------------------------------------------------------------


def hf_to_params(tensors: Mapping[str, np.ndarray], config: QwenConfig) -> dict:
    """HF state dict (numpy) → agentrl parameter tree (stacked layers, numpy)."""
    params: dict = {}
    for path, mapping, is_layer in param_paths(config):
        if is_layer:
            stacked = [mapping.to_params(np.asarray(tensors[mapping.hf_name.format(i=i)]), config)
                       for i in range(config.num_hidden_layers)]
            _set(params, path, np.stack(stacked))
        else:
            _set(params, path, mapping.to_params(np.asarray(tensors[mapping.hf_name]), config))
    return params


def params_to_hf(params: Mapping, config: QwenConfig) -> dict[str, np.ndarray]:
    """agentrl parameter tree (stacked) → HF state dict (numpy, contiguous)."""
    tensors = {}
    for path, mapping, is_layer in param_paths(config):
        value = np.asarray(jax.device_get(_get(params, path)))
        if is_layer:
            for i in range(config.num_hidden_layers):
                name = mapping.hf_name.format(i=i)
                tensors[name] = np.ascontiguousarray(mapping.to_hf(value[i], config))
        else:
            tensors[mapping.hf_name] = np.ascontiguousarray(mapping.to_hf(value, config))
    return tensors


# ---------------------------------------------------------------------------
# Reading a checkpoint directory.
# ---------------------------------------------------------------------------


class SafetensorsReader:
    """Memory-mapped access to the tensors of an HF checkpoint directory.

    Handles a single `model.safetensors` or a sharded set with
    `model.safetensors.index.json`. Tensors are read lazily by name.
    """

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        index = self.directory / SAFETENSORS_INDEX
        single = self.directory / SAFETENSORS_SINGLE
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            with safe_open(single, framework="numpy") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {self.directory}; pass a "
                "Hugging Face checkpoint directory (save_pretrained layout)."
            )
        self._handles: dict[pathlib.Path, Any] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}.")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="numpy")
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


# ---------------------------------------------------------------------------
# Layer layout: stacked (nn.scan) ⇄ one subtree per layer.
# ---------------------------------------------------------------------------


def unstack_layers(params: Mapping, num_layers: int) -> dict:
    """Stacked `layers/layer/...` → `layers_{i}/layer/...` (for `scan_layers=False`)."""
    params = dict(params)
    stacked = params.pop("layers")
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
    return params


def stack_layers(params: Mapping, num_layers: int) -> dict:
    """`layers_{i}/...` → stacked `layers/...`; a stacked tree is returned unchanged."""
    if "layers" in params:
        return dict(params)
    params = dict(params)
    per_layer = [params.pop(f"layers_{i}") for i in range(num_layers)]
    params["layers"] = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                              *per_layer)
    return params


# ---------------------------------------------------------------------------
# Sharded loading.
# ---------------------------------------------------------------------------


def _slice_callback(reader: SafetensorsReader, mapping: TensorMap, config: QwenConfig,
                    is_layer: bool, dtype):
    """`index → numpy shard` for `jax.make_array_from_callback`."""

    def load(index: tuple[slice, ...]) -> np.ndarray:
        if not is_layer:
            full = mapping.to_params(reader.get(mapping.hf_name), config)
            return np.asarray(full[index], dtype=dtype)
        layers = range(config.num_hidden_layers)[index[0]]
        per_layer = [
            mapping.to_params(reader.get(mapping.hf_name.format(i=i)), config)[index[1:]]
            for i in layers
        ]
        return np.asarray(np.stack(per_layer), dtype=dtype)

    return load


def load_sharded_params(
    directory: str | pathlib.Path,
    config: QwenConfig,
    shardings: Mapping,
    shapes: Mapping,
    *,
    show_progress: bool = False,
) -> dict:
    """Reads an HF checkpoint straight into sharded arrays (stacked layout).

    Each parameter is built by `jax.make_array_from_callback`: every device
    shard reads only the HF tensors it needs, so no device ever holds more than
    its shards.

    Args:
      directory: HF checkpoint directory.
      config: the model config (`param_dtype` sets the stored dtype).
      shardings: tree of `jax.sharding.Sharding`, stacked layout.
      shapes: tree of `jax.ShapeDtypeStruct` (or arrays), stacked layout.
      show_progress: show a progress bar over the parameters.

    Returns:
      The parameter tree of `jax.Array`s.
    """
    reader = SafetensorsReader(directory)
    dtype = np.dtype(jax.numpy.dtype(config.param_dtype))
    missing = sorted(name for name in hf_tensor_names(config) if name not in reader.files)
    if missing:
        raise KeyError(
            f"checkpoint {directory} lacks tensors {missing[:5]}"
            f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''} for a "
            f"{config.model_type} config "
            f"(tie_word_embeddings={config.tie_word_embeddings}, attention_bias="
            f"{config.attention_bias}, qk_norm={config.qk_norm}); is config.json the model's?"
        )
    params: dict = {}
    entries = list(param_paths(config))
    try:
        for path, mapping, is_layer in progress(entries, total=len(entries),
                                                desc=f"loading {directory}",
                                                enabled=show_progress):
            shape = tuple(_get(shapes, path).shape)
            sharding = _get(shardings, path)
            callback = _slice_callback(reader, mapping, config, is_layer, dtype)
            _set(params, path, jax.make_array_from_callback(shape, sharding, callback))
    finally:
        reader.close()
    return params


# ---------------------------------------------------------------------------
# Writing an HF checkpoint directory.
# ---------------------------------------------------------------------------


def save_hf_checkpoint(
    directory: str | pathlib.Path,
    params: Mapping,
    config: QwenConfig,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: str | None = None,
    show_progress: bool = False,
) -> pathlib.Path:
    """Writes `config.json`, `generation_config.json` and safetensors that
    `transformers` (and vLLM) load, sharded with an index above `max_shard_bytes`.

    Args:
      directory: output directory (created).
      params: agentrl parameters (stacked or per-layer layout; LoRA adapters,
        if any, must be merged first: `agentrl.models.lora.merge_lora`).
      config: the model config.
      max_shard_bytes: largest safetensors file.
      dtype: stored dtype (default `config.param_dtype`).
      show_progress: show a progress bar over the files written.

    Returns:
      The directory.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    params = stack_layers(params, config.num_hidden_layers)
    dtype = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
    tensors = {name: value.astype(dtype) for name, value in params_to_hf(params, config).items()}
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(jax.numpy.dtype(dtype).name)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2),
                                                      encoding="utf-8")
    save_hf_tensors(directory, tensors, max_shard_bytes=max_shard_bytes,
                    show_progress=show_progress)
    return directory


def shard_names(tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> dict[str, str]:
    """`{tensor name: safetensors file}`: sorted names packed greedily into files.

    One file is `model.safetensors`; several are
    `model-00001-of-0000N.safetensors`, ... (transformers' naming).
    """
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SAFETENSORS_SINGLE)
    files = {}
    for number, group in enumerate(groups, start=1):
        files.update(dict.fromkeys(group, f"model-{number:05d}-of-{len(groups):05d}.safetensors"))
    return files


def save_hf_tensors(
    directory: str | pathlib.Path,
    tensors: Mapping[str, np.ndarray],
    *,
    max_shard_bytes: int = 5 * 1024**3,
    file_of: Mapping[str, str] | None = None,
    show_progress: bool = False,
) -> pathlib.Path:
    """Writes an HF state dict as safetensors files (+ index when there are several).

    Args:
      directory: existing output directory.
      tensors: `{HF name: numpy array}`.
      max_shard_bytes: largest file (ignored when `file_of` is given).
      file_of: `{HF name: file name}`, to keep another checkpoint's layout.
      show_progress: show a progress bar over the files.

    Returns:
      The directory.
    """
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    file_of = dict(file_of) if file_of is not None else shard_names(tensors, max_shard_bytes)
    missing = sorted(set(tensors) - set(file_of))
    if missing:
        raise KeyError(f"save_hf_tensors: file_of has no file for tensors {missing[:5]}.")
    by_file: dict[str, list[str]] = {}
    for name in sorted(tensors):
        by_file.setdefault(file_of[name], []).append(name)
    metadata = {"format": "pt"}
    for file, names in progress(sorted(by_file.items()), total=len(by_file),
                                desc=f"writing {directory}", enabled=show_progress):
        shard = {name: np.ascontiguousarray(tensors[name]) for name in names}
        save_file(shard, str(directory / file), metadata=metadata)
    # Shards of an earlier save with another count would be loaded too by
    # readers that glob `*.safetensors` (vLLM without an index).
    for stale in directory.glob("model-*-of-*.safetensors"):
        if stale.name not in by_file:
            stale.unlink()
    if len(by_file) == 1 and SAFETENSORS_SINGLE in by_file:
        (directory / SAFETENSORS_INDEX).unlink(missing_ok=True)
        return directory
    index = {"metadata": {"total_size": sum(int(t.nbytes) for t in tensors.values())},
             "weight_map": {name: file_of[name] for name in sorted(tensors)}}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
    if SAFETENSORS_SINGLE not in by_file:
        (directory / SAFETENSORS_SINGLE).unlink(missing_ok=True)
    return directory
