"""Shared serving fixtures: one tiny HF checkpoint and one served backend per test process.

Compiling the JAX engine dominates the serving tests' time (a few seconds per
batch-shape bucket on CPU), so test_server.py and test_vllm_engine.py share
one `GenerationBackend` (cached here) and put as many HTTP front ends over it
as they need; each test leaves the backend's weights and adapters as it found
them.
"""

import atexit
import functools
import pathlib
import shutil
import socket
import tempfile

import flax.linen as nn
import jax
import numpy as np

from agentrl.models import Policy, model_config
from agentrl.models.lora import lora_spec, split_lora
from agentrl.models.policy import abstract_params
from agentrl.models.qwen import QwenModel
from agentrl.rollout.server import build_backend

SERVED = "policy"
MAX_BATCH = 2


@functools.cache
def workdir() -> pathlib.Path:
    path = pathlib.Path(tempfile.mkdtemp(prefix="agentrl-serving-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def checkpoint() -> pathlib.Path:
    """A random tiny Qwen2 (full Qwen vocabulary, so the bundled tokenizer fits) as HF files."""
    return pathlib.Path(Policy.init(model_config("tiny"), 0).save_pretrained(workdir() / "base"))


@functools.cache
def backend():
    served = build_backend(str(checkpoint()), max_batch_size=MAX_BATCH, served_model_name=SERVED,
                           tokenizer="qwen2.5", seed=0)
    _original.append(served.base_params)
    return served


_original: list = []


def original_params():
    """The checkpoint's parameters, as first loaded (reload tests swap others in)."""
    backend()
    return _original[0]


def restore() -> None:
    """Serves `checkpoint()` again (what a weight-reload test must leave behind)."""
    served = backend()
    served.update_config({"model_config": {"model": str(checkpoint())}})
    served.reload_weights()


def perturbed_params(scale: float = 0.5, seed: int = 1):
    """The original parameters plus Gaussian noise (numpy; no compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: (np.asarray(x) + scale * rng.standard_normal(x.shape)).astype(x.dtype),
        original_params())


def perturbed_checkpoint(name: str, scale: float = 0.5, seed: int = 1) -> pathlib.Path:
    """`perturbed_params` saved as another HF checkpoint."""
    policy = Policy(backend().config, perturbed_params(scale, seed))
    return pathlib.Path(policy.save_pretrained(workdir() / name))


def random_adapters(rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """`(spec, adapters)`: nonzero LoRA matrices on every projection of the served model."""
    spec = lora_spec(rank, alpha)
    shapes = nn.meta.unbox(abstract_params(QwenModel(backend().config, spec)))
    _, adapter_shapes = split_lora(shapes)
    rng = np.random.default_rng(seed)
    adapters = jax.tree_util.tree_map(
        lambda s: (0.5 * rng.standard_normal(s.shape)).astype(np.float32), adapter_shapes)
    return spec, adapters


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class SilentServer:
    """Accepts TCP connections (kernel backlog) and never answers: requests time out."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()
