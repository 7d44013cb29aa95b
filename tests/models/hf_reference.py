"""Tiny random Hugging Face Qwen checkpoints: the numeric reference for the model tests."""

import numpy as np
import torch
import transformers

VOCAB = 300
VARIANTS = {
    "qwen2_tied": ("qwen2", True),
    "qwen2_untied": ("qwen2", False),
    "qwen3_tied": ("qwen3", True),
    "qwen3_untied": ("qwen3", False),
}


def hf_config(family: str, tie: bool, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                  max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6)
    common.update(overrides)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    # Qwen3: head_dim (24) is not hidden_size / num_attention_heads (16).
    return transformers.Qwen3Config(head_dim=24, **common)


def build_hf_model(family: str, tie: bool, seed: int = 0, **overrides):
    """A random HF model whose norms and biases are not at their init values."""
    torch.manual_seed(seed)
    config = hf_config(family, tie, **overrides)
    model_class = (transformers.Qwen2ForCausalLM if family == "qwen2"
                   else transformers.Qwen3ForCausalLM)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def hf_forward(model, tokens, attention_mask=None, position_ids=None):
    """`(logits [B, T, V], hidden_states tuple)` as numpy, fp32."""
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(attention_mask))
    if position_ids is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(position_ids))
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens)), output_hidden_states=True, **kwargs)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]
