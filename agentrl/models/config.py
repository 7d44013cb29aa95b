"""Qwen2 / Qwen2.5 / Qwen3 (dense) model configuration.

One dataclass covers both families: Qwen2/2.5 (bias on the q/k/v projections,
`head_dim = hidden_size / num_attention_heads`) and Qwen3 dense (RMSNorm on q
and k per head, no qkv bias, `head_dim` independent of the hidden size).
`QwenConfig.from_hf` reads a Hugging Face `config.json`; `to_hf` writes one
that `transformers` loads.
"""

import dataclasses
import json
import pathlib
from typing import Any

MODEL_TYPES = ("qwen2", "qwen3")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture (from the HF config) and runtime options (ours).

    Architecture fields keep the Hugging Face names. Runtime fields:
      dtype: compute dtype of matmuls and activations.
      param_dtype: storage dtype of the parameters.
      remat: rematerialisation policy of each decoder layer: `"none"`,
        `"full"` (save nothing), `"dots"` (save matmul outputs),
        `"dots_no_batch"` (save matmuls without batch dims).
      scan_layers: run the decoder layers under `nn.scan` (one compiled layer;
        parameters stacked on a leading `layers` axis).
      attention_impl: `jax.nn.dot_product_attention`'s `implementation`
        (None: XLA; `"cudnn"`: cuDNN flash attention on GPU).
      logits_chunk_size: sequence chunk of the memory-efficient log-prob /
        entropy path (never materialises `[B, T, V]`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    model_type: str = "qwen2"
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    qk_norm: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    # Runtime.
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = True
    attention_impl: str | None = None
    logits_chunk_size: int = 512

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        checks = [
            ("model_type", self.model_type, MODEL_TYPES),
            ("remat", self.remat, REMAT_POLICIES),
            ("dtype", self.dtype, DTYPES),
            ("param_dtype", self.param_dtype, DTYPES),
        ]
        for name, value, choices in checks:
            if value not in choices:
                raise ValueError(
                    f"QwenConfig.{name}={value!r} is not supported; use one of {choices}."
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"QwenConfig: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"QwenConfig.head_dim={self.head_dim} must be even for RoPE.")

    def replace(self, **changes) -> "QwenConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, path_or_dict: str | pathlib.Path | dict[str, Any], **runtime) -> "QwenConfig":
        """Builds a config from an HF `config.json` (a path, a directory, or the dict).

        Runtime options (`dtype`, `remat`, ...) are keyword arguments.
        """
        if isinstance(path_or_dict, dict):
            hf = path_or_dict
        else:
            path = pathlib.Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"QwenConfig.from_hf: no config.json at {path}; pass a checkpoint directory, "
                    "its config.json, or the config dict."
                )
            hf = json.loads(path.read_text(encoding="utf-8"))
        model_type = hf.get("model_type", "qwen2")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"QwenConfig.from_hf: model_type={model_type!r} is not supported; agentrl "
                f"implements {MODEL_TYPES} (dense); MoE variants (qwen2_moe, qwen3_moe) are not "
                "built."
            )
        # transformers < 5 writes `rope_scaling`; transformers >= 5 `rope_parameters`.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise NotImplementedError(
                f"QwenConfig.from_hf: RoPE scaling {rope!r} (YaRN / dynamic RoPE) is not "
                "implemented; remove it from config.json to use the native context length."
            )
        if hf.get("use_sliding_window"):
            raise NotImplementedError(
                "QwenConfig.from_hf: use_sliding_window=true is not implemented; set it to false "
                "in config.json (the released dense Qwen models have it off)."
            )
        is_qwen3 = model_type == "qwen3"
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or 0,
            model_type=model_type,
            rope_theta=float(rope_theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", not is_qwen3),
            qk_norm=is_qwen3,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            **runtime,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict (`Qwen2ForCausalLM` / `Qwen3ForCausalLM`)."""
        is_qwen3 = self.model_type == "qwen3"
        hf = {
            "architectures": ["Qwen3ForCausalLM" if is_qwen3 else "Qwen2ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.param_dtype,
        }
        if is_qwen3:
            hf["attention_bias"] = self.attention_bias
        return hf


def _preset(**kwargs) -> QwenConfig:
    return QwenConfig(**kwargs)


PRESETS: dict[str, QwenConfig] = {
    # A few-million-parameter model for tests and the CPU demo.
    "tiny": _preset(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "qwen2_5_0_5b": _preset(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2_5_1_5b": _preset(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2_5_3b": _preset(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2_5_7b": _preset(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "qwen3_0_6b": _preset(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3",
        attention_bias=False, qk_norm=True, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3_1_7b": _preset(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3",
        attention_bias=False, qk_norm=True, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3_4b": _preset(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, model_type="qwen3",
        attention_bias=False, qk_norm=True, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3_8b": _preset(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, model_type="qwen3",
        attention_bias=False, qk_norm=True, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
}


def model_config(name: str, **runtime) -> QwenConfig:
    """A named architecture (`"tiny"`, `"qwen2_5_7b"`, `"qwen3_8b"`, ...) with runtime options."""
    if name not in PRESETS:
        raise KeyError(f"unknown model config {name!r}; available: {sorted(PRESETS)}.")
    return PRESETS[name].replace(**runtime)


def param_count(config: QwenConfig) -> int:
    """Number of parameters, counted from the architecture (no allocation).

    Per layer: q/k/v/o projections (+ q/k/v biases for Qwen2, + q/k norms for
    Qwen3), gate/up/down MLP, two RMSNorms; plus the embedding, the final norm
    and an untied LM head.
    """
    d, f = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    attention = d * q_out + 2 * d * kv_out + q_out * d
    if config.attention_bias:
        attention += q_out + 2 * kv_out
    if config.qk_norm:
        attention += 2 * config.head_dim
    layer = attention + 3 * d * f + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * layer + embeddings + d
