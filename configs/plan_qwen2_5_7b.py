"""Memory plan of Qwen2.5-7B full fine-tuning on H100s (80 GB), FSDP over all devices.

    agentrl plan --config configs/plan_qwen2_5_7b.py           # 8 devices
    agentrl plan --config configs/plan_qwen2_5_7b.py:16 --config.batch_size=16 --json

`arg` is the device count (default 8); the mesh is `fsdp = arg`. The fields
are the ones the trainer's configs carry (`model`, `mesh`, `batch_size`,
`seq_len`, `dtype`, `remat`, `device_memory_gb`), so `agentrl plan --config`
works on a training config too.
"""

import ml_collections


def get_config(arg: str = "8") -> ml_collections.ConfigDict:
    devices = int(arg)
    config = ml_collections.ConfigDict()
    config.model = "qwen2_5_7b"  # a preset, or a path to an HF config.json
    config.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": devices, "tensor": 1})
    config.batch_size = devices  # sequences per micro-batch, all devices together
    config.seq_len = 4096
    config.dtype = "bfloat16"  # parameters and compute; AdamW moments stay float32
    config.remat = "full"
    config.attention_impl = "xla"  # "cudnn" on GPU drops the [T, T] attention scores
    config.device_memory_gb = 80.0
    config.memory_fraction = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION
    return config
