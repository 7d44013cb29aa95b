"""Checkpoint conversion behind `agentrl convert`.

    agentrl convert hf-to-orbax   SRC_HF DST_ORBAX [--dtype bfloat16] [--step N]
    agentrl convert orbax-to-hf   SRC_ORBAX DST_HF [--dtype bfloat16] [--step N]
    agentrl convert merge-lora    BASE_HF ADAPTER_DIR DST_HF [--dtype bfloat16]
    agentrl convert orbax-to-peft SRC_ORBAX DST_ADAPTER [--step N] [--base-model NAME]

Conversions run on the host's CPU devices (never the accelerator), with the
parameters sharded over all of them; progress bars go to stderr. LoRA
adapters in an orbax checkpoint are merged into the kernels by `orbax-to-hf`
and exported unmerged by `orbax-to-peft`. `merge-lora` works tensor by tensor
in the HF layout (`W ← W + (α/r) B A`, as `peft`'s `merge_and_unload`) and
keeps the base checkpoint's files, shard layout and tokenizer.
"""

import json
import pathlib
import shutil

import jax
import numpy as np
from safetensors.numpy import save_file

from agentrl import parallel
from agentrl.models import lora as lora_lib
from agentrl.models import weights
from agentrl.models.config import QwenConfig
from agentrl.models.qwen import QwenModel

HF_DTYPES = ("float32", "bfloat16", "float16")


def conversion_mesh() -> jax.sharding.Mesh:
    """All local CPU devices on the `fsdp` axis: conversion memory is host memory."""
    devices = jax.local_devices(backend="cpu")
    return parallel.make_mesh(parallel.MeshConfig(data=1, fsdp=-1, tensor=1), devices=devices)


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in HF_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {HF_DTYPES}.")


def hf_to_orbax(
    src: str | pathlib.Path,
    dst: str | pathlib.Path,
    *,
    dtype: str = "float32",
    step: int | None = None,
    show_progress: bool = True,
) -> pathlib.Path:
    """HF checkpoint directory → orbax parameter checkpoint (`save_params` layout).

    Args:
      src: HF directory (`config.json` + safetensors).
      dst: new checkpoint directory (with `step`, a directory of steps).
      dtype: stored parameter dtype (also the stored config's `dtype`).
      step: save as this step of a directory of steps.
      show_progress: progress bar over the parameters.

    Returns:
      The checkpoint directory.
    """
    from agentrl.models.policy import param_shardings
    from agentrl.train.checkpoint import save_params

    _check_dtype(dtype)
    config = QwenConfig.from_hf(src, dtype=dtype, param_dtype=dtype)
    shardings, shapes = param_shardings(QwenModel(config), conversion_mesh())
    params = weights.load_sharded_params(src, config, shardings, shapes,
                                         show_progress=show_progress)
    return save_params(dst, params, config, step=step)


def orbax_to_hf(
    src: str | pathlib.Path,
    dst: str | pathlib.Path,
    *,
    dtype: str | None = None,
    step: int | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    show_progress: bool = True,
) -> pathlib.Path:
    """Orbax parameter checkpoint → HF directory that transformers and vLLM load.

    LoRA adapters in the checkpoint are merged into their kernels.

    Args:
      src: a `save_params` checkpoint or a directory of steps.
      dst: output directory (created; existing safetensors are replaced).
      dtype: stored dtype (default: the checkpoint's `param_dtype`).
      step: the step to convert (default: `src` itself, else the latest).
      max_shard_bytes: largest safetensors file.
      show_progress: progress bar over the files written.

    Returns:
      The HF directory.
    """
    from agentrl.train.checkpoint import restore_lora_spec, restore_params

    _check_dtype(dtype)
    config, params = restore_params(src, mesh=conversion_mesh(), step=step)
    _, adapters = lora_lib.split_lora(params)
    if adapters:
        spec = restore_lora_spec(src, step=step)
        if spec is None:
            raise ValueError(
                f"orbax checkpoint {src} holds LoRA adapters but no LoRA settings; save it with "
                "save_params(..., lora=spec) so that they can be merged."
            )
        params = lora_lib.merge_lora(params, spec)
    return weights.save_hf_checkpoint(dst, params, config, dtype=dtype,
                                      max_shard_bytes=max_shard_bytes,
                                      show_progress=show_progress)


def orbax_to_peft(
    src: str | pathlib.Path,
    dst: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    base_model_name_or_path: str | None = None,
) -> pathlib.Path:
    """The LoRA adapters of an orbax checkpoint → PEFT adapter directory (for vLLM)."""
    from agentrl.train.checkpoint import restore_lora_spec, restore_params

    _check_dtype(dtype)
    spec = restore_lora_spec(src, step=step)
    if spec is None:
        raise ValueError(
            f"orbax checkpoint {src} has no LoRA adapters (saved without lora=spec); export the "
            "full model with `agentrl convert orbax-to-hf` instead."
        )
    config, params = restore_params(src, mesh=conversion_mesh(), step=step)
    return lora_lib.save_peft_adapter(dst, params, spec, config, dtype=dtype,
                                      base_model_name_or_path=base_model_name_or_path)


def _copy_side_files(base: pathlib.Path, dst: pathlib.Path, dtype: str | None) -> None:
    """config.json, tokenizer and generation files of `base` (not its weights)."""
    for path in base.iterdir():
        if (not path.is_file() or path.suffix == ".safetensors"
                or path.name == weights.SAFETENSORS_INDEX):
            continue
        shutil.copy2(path, dst / path.name)
    if dtype is not None:
        config_file = dst / "config.json"
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
        hf_config["torch_dtype"] = dtype
        if "dtype" in hf_config:  # transformers >= 5
            hf_config["dtype"] = dtype
        config_file.write_text(json.dumps(hf_config, indent=2), encoding="utf-8")


def merge_lora_into_hf(
    base: str | pathlib.Path,
    adapter: str | pathlib.Path,
    dst: str | pathlib.Path,
    *,
    dtype: str | None = None,
    show_progress: bool = True,
) -> pathlib.Path:
    """A PEFT LoRA adapter merged into an HF checkpoint, written as a new HF checkpoint.

    Each adapted weight becomes `W + (α/r) B A` (computed in float32, stored
    in `W`'s dtype or `dtype`); all other tensors and files are copied.

    Args:
      base: the base HF checkpoint directory (the adapter's base model).
      adapter: PEFT adapter directory.
      dst: new output directory (not `base`; no safetensors in it yet).
      dtype: stored dtype of floating tensors (default: the base's).
      show_progress: progress bar over the tensors.

    Returns:
      The output directory.
    """
    _check_dtype(dtype)
    base, dst = pathlib.Path(base), pathlib.Path(dst)
    if dst.resolve() == base.resolve():
        raise ValueError(f"merge-lora: the output {dst} is the base checkpoint; pass a new "
                         "directory.")
    config = QwenConfig.from_hf(base)
    spec, matrices = lora_lib.read_peft_adapter(adapter, config)
    scale = spec.alpha / spec.rank
    reader = weights.SafetensorsReader(base)
    updates = {lora_lib.hf_module_name(layer, target) + ".weight": pair
               for (layer, target), pair in matrices.items()}
    missing = sorted(set(updates) - set(reader.files))
    if missing:
        raise KeyError(f"merge-lora: the base checkpoint {base} lacks {missing[:5]}, which the "
                       f"adapter {adapter} adapts; pass the adapter's base model.")
    if dst.is_dir() and any(dst.glob("*.safetensors")):
        raise FileExistsError(f"merge-lora: {dst} already holds safetensors files; pass a new "
                              "directory or empty this one.")
    dst.mkdir(parents=True, exist_ok=True)
    out_dtype = None if dtype is None else jax.numpy.dtype(dtype)
    # One file at a time: host memory holds one shard of the base, not the model.
    order = sorted(reader.files.items(), key=lambda item: (item[1].name, item[0]))
    tensors: dict[str, np.ndarray] = {}
    current = None
    total_size = 0
    try:
        for name, file in weights.progress(order, total=len(order), desc=f"merging {adapter}",
                                           enabled=show_progress):
            if file != current and tensors:
                save_file(tensors, str(dst / current.name), metadata={"format": "pt"})
                tensors = {}
            current = file
            tensors[name] = _merged(reader.get(name), updates.get(name), scale, out_dtype)
            total_size += tensors[name].nbytes
        if tensors:
            save_file(tensors, str(dst / current.name), metadata={"format": "pt"})
    finally:
        reader.close()
    _copy_side_files(base, dst, dtype)
    if (base / weights.SAFETENSORS_INDEX).is_file():
        index = {"metadata": {"total_size": total_size},
                 "weight_map": {name: file.name for name, file in sorted(reader.files.items())}}
        (dst / weights.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2),
                                                     encoding="utf-8")
    return dst


def _merged(tensor: np.ndarray, pair, scale: float, out_dtype) -> np.ndarray:
    """`W + scale · B A` (float32) when `pair = (A [r, in], B [out, r])`, cast to `out_dtype`."""
    if pair is not None:
        lora_a, lora_b = pair
        delta = lora_b.astype(np.float32) @ lora_a.astype(np.float32)
        tensor = (tensor.astype(np.float32) + scale * delta).astype(tensor.dtype)
    if out_dtype is not None and jax.numpy.issubdtype(tensor.dtype, jax.numpy.floating):
        tensor = tensor.astype(out_dtype)
    return np.ascontiguousarray(tensor)


def parse_size(text: str) -> int:
    """`"5GB"`, `"500MB"`, `"20KB"` or a byte count → bytes (powers of 1000, as transformers)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * units[unit])
    if not upper.isdigit():
        raise ValueError(f"size {text!r} is not understood; write e.g. 5GB, 500MB or 1000000.")
    return int(upper)
