"""Qwen2/Qwen3 policy and critic models, weights, tokenizer and chat format.

The facade of DESIGN.md:

    get_tokenizer("qwen3").encode("Hello")          # [9707]
    config = model_config("qwen2_5_7b"); param_count(config)   # 7_615_616_512
    QwenConfig.from_hf("/ckpt/Qwen2.5-7B-Instruct")
    policy = load_pretrained("/ckpt/Qwen2.5-7B-Instruct", dtype="bfloat16", mesh=mesh)
    policy.logits(tokens, attention_mask)            # [B, T, V]
    policy.save_pretrained("/ckpt/export")           # loadable by transformers / vLLM
"""

from agentrl.models.config import PRESETS, QwenConfig, model_config, param_count
from agentrl.models.heads import (
    CarlValueHead,
    LinearValueHead,
    PolicyValueModel,
    ValueModel,
)
from agentrl.models.policy import Policy, load_pretrained
from agentrl.models.qwen import (
    KVCache,
    LoraSpec,
    QwenModel,
    init_cache,
    token_logprobs_and_entropy,
)
from agentrl.models.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "PRESETS",
    "CarlValueHead",
    "KVCache",
    "LinearValueHead",
    "LoraSpec",
    "Policy",
    "PolicyValueModel",
    "QwenConfig",
    "QwenModel",
    "Tokenizer",
    "ValueModel",
    "get_tokenizer",
    "init_cache",
    "load_pretrained",
    "model_config",
    "param_count",
    "token_logprobs_and_entropy",
]
