"""What the experiment configs share: the `arg` grammar, model settings, CPU sizes.

Not a config (it has no `get_config`). ml-collections loads a config file by
its path, not as a module of a package, so the configs load this file by path
too (`load_sibling(__file__, "common.py")` at the top of each config;
`agentrl.train.config.load_sibling`).

The `arg` grammar (`--config configs/FILE.py:ARG`):

    ARG   := "" | TOKEN ("," TOKEN)*
    TOKEN := one value of one of the file's axes; at most one per axis, any order

Every file has the axes `model` (default `tiny`) and `engine` (`jax` default,
or `vllm`; not in cpu_demo.py); each adds its own (e.g. `level` in cm2.py). A
missing axis takes its default, so `"qwen2_5_7b,step"` ==
`"step,qwen2_5_7b,jax"` in cm2.py. An unknown token, or two tokens of one
axis, raise a ValueError that lists every axis.

`model`:

* `tiny`: the few-million-parameter Qwen2 preset, random init, float32, the
  bundled tokenizer, the built-in task, an SFT warm start and sizes that run in
  minutes on a CPU (`tiny()` below).
* a preset of `agentrl.models.model_config` (`qwen2_5_7b`, `qwen3_8b`, ...):
  the paper's scale. `model.hf_path` points at the paper's checkpoint under
  `MODELS_DIR` (override it: `--config.model.hf_path=/path/to/Qwen2.5-7B`);
  bfloat16, full remat (all papers enable gradient checkpointing), FSDP over
  every device.

`engine`: `jax` generates in process (`JaxEngine`); `vllm` sends generation to
the vLLM servers of `launch/vllm_servers.sh` (default one at
`http://localhost:8000` serving model `policy`; list yours with
`--config.rollout.vllm_urls=http://h1:8000 --config.rollout.vllm_urls=http://h2:8000`).
"""

from collections.abc import Mapping, Sequence

import ml_collections

MODELS_DIR = "/models"  # where paper-scale variants look for HF checkpoints

ENGINES = ("jax", "vllm")
VLLM_URL = "http://localhost:8000"  # `vllm serve` / launch/vllm_servers.sh default port
VLLM_MODEL = "policy"  # --served-model-name of launch/vllm_servers.sh
TOKENIZER_VOCAB = 151665  # ids the bundled Qwen2.5 tokenizer defines (the preset pads to 151936)

# One place for the CPU sizes of every `tiny` variant (not paper numbers: a
# random-init model with hidden size 64 needs an SFT warm start and large steps).
TINY = dict(
    prompts_per_step=4,      # prompts per RL step
    max_step_tokens=48,      # tokens per policy generation (a tool call fits in ~35)
    max_context_tokens=512,  # prompt + all steps
    train_size=256,          # built-in task instances for training
    eval_size=32,
    rl_steps=20,
    eval_every=10,
    checkpoint_every=10,
    actor_lr=1e-4,
    critic_lr=1e-4,          # value head / separate critic (PPO, MT-PPO, CARL)
    sft_steps=100,           # SFT warm start on the task's demonstrations
    sft_batch_size=16,
    sft_lr=1e-3,
    sft_demonstrations=256,
)


def parse_arg(arg: str, axes: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """`"qwen2_5_7b,step"` → `{"model": "qwen2_5_7b", "level": "step", ...}`.

    Args:
      arg: the text after `:` in `--config FILE.py:ARG`.
      axes: axis name → its values; the first value is the default. Values must
        be unique across axes.

    Raises:
      ValueError: unknown token, or two tokens for one axis.
    """
    owner = {}
    for axis, values in axes.items():
        for value in values:
            if value in owner:
                raise ValueError(f"parse_arg: value {value!r} is on axes {owner[value]!r} and "
                                 f"{axis!r}; values must be unique across axes.")
            owner[value] = axis
    chosen = {axis: values[0] for axis, values in axes.items()}
    seen = {}
    grammar = "; ".join(f"{axis}: {'|'.join(values)}" for axis, values in axes.items())
    for token in (t.strip() for t in arg.split(",")):
        if not token:
            continue
        if token not in owner:
            raise ValueError(f"config arg {arg!r}: unknown token {token!r}. Write "
                             f"TOKEN[,TOKEN...] with at most one token per axis ({grammar}).")
        axis = owner[token]
        if axis in seen:
            raise ValueError(f"config arg {arg!r}: {seen[axis]!r} and {token!r} both set axis "
                             f"{axis!r}; give one ({grammar}).")
        seen[axis] = token
        chosen[axis] = token
    return chosen


def tiny(c: ml_collections.ConfigDict) -> None:
    """CPU sizes for the `tiny` model (the numbers are in `TINY`)."""
    c.model.name = "tiny"
    c.model.hf_path = ""
    c.model.dtype = "float32"
    c.model.remat = "none"
    # The bundled tokenizer renumbered to the ids of the task's texts: a random
    # tiny model with the full 151,936-way output layer is 20x slower and samples
    # ids that never occur (agentrl.models.tokenizer.CompactTokenizer).
    c.model.compact_vocab = True
    c.tokenizer = "qwen2.5"  # bundled with agentrl (no network)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.task.train_size = TINY["train_size"]
    c.task.eval_size = TINY["eval_size"]
    c.rollout.prompts_per_step = TINY["prompts_per_step"]
    c.rollout.max_step_tokens = TINY["max_step_tokens"]
    c.rollout.max_context_tokens = TINY["max_context_tokens"]
    c.train.steps = TINY["rl_steps"]
    c.train.eval_every = TINY["eval_every"]
    c.train.checkpoint_every = TINY["checkpoint_every"]
    c.optim.actor.learning_rate = TINY["actor_lr"]
    c.optim.critic.learning_rate = TINY["critic_lr"]
    c.sft.steps = TINY["sft_steps"]
    c.sft.batch_size = TINY["sft_batch_size"]
    c.sft.learning_rate = TINY["sft_lr"]
    c.sft.demonstrations = TINY["sft_demonstrations"]


def paper_model(c: ml_collections.ConfigDict, preset: str, checkpoint: str) -> None:
    """Paper scale: `preset` architecture, weights from `MODELS_DIR/checkpoint`."""
    c.model.name = preset
    c.model.hf_path = f"{MODELS_DIR}/{checkpoint}"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"  # every paper enables gradient checkpointing
    c.tokenizer = "qwen3" if preset.startswith("qwen3") else "qwen2.5"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1  # FSDP over all devices (ZeRO-3 / FSDP)
    c.sft.steps = 0  # the papers' cold-start SFT is its own stage; see each config


def engine(c: ml_collections.ConfigDict, name: str) -> None:
    """`jax`: in-process JaxEngine; `vllm`: external servers (launch/vllm_servers.sh)."""
    c.rollout.engine = name
    if name == "vllm":
        c.rollout.vllm_urls = (VLLM_URL,)
        c.rollout.vllm_model = VLLM_MODEL
        if c.model.compact_vocab:  # vLLM serves HF exports: keep the tokenizer's own ids,
            c.model.compact_vocab = False  # trimmed to the 151,665 it defines
            c.model.overrides = {**c.model.overrides, "vocab_size": TOKENIZER_VOCAB}


def num_minibatches(trajectories: int, minibatch: int) -> int:
    """Gradient steps per PPO epoch for a mini-batch of `minibatch` trajectories."""
    if trajectories % minibatch:
        raise ValueError(f"{trajectories} trajectories per step is not a multiple of the "
                         f"mini-batch {minibatch}.")
    return trajectories // minibatch
