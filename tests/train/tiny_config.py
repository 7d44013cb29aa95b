"""Tiny, fast training configs for the trainer tests (CPU, seconds per step)."""

from agentrl.train.config import base_config, load_config


def shrink(c, workdir, *, steps=1):
    """Makes any config tiny: a 2-layer 32-wide model, few prompts, short contexts."""
    c.workdir = str(workdir)
    c.model.name = "tiny"
    c.model.hf_path = ""
    c.model.dtype = "float32"
    c.model.compact_vocab = True
    c.model.overrides = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=1024)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    c.task.train_size = 16
    c.task.eval_size = 2
    c.rollout.engine = "jax"
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 2
    c.rollout.tree_n = 2
    c.rollout.max_step_tokens = 12
    c.rollout.max_steps = min(c.rollout.max_steps, 2)
    c.rollout.max_context_tokens = 768 if c.task.name == "multiturn_tools" else 384
    c.rollout.max_batch_size = 8
    c.sft.steps = 2
    c.sft.batch_size = 2
    c.sft.demonstrations = 4
    c.train.steps = steps
    c.train.ppo_epochs = 1
    c.train.num_minibatches = 1
    c.train.eval_every = 0
    c.train.checkpoint_every = 1
    c.warmup.steps = 0
    return c


def tiny_from(spec, workdir, *, steps=1, overrides=()):
    return shrink(load_config(spec, list(overrides)).copy_and_resolve_references(), workdir,
                  steps=steps)


def tiny_base(workdir, *, steps=1):
    c = base_config()
    c.task.options = {"compact_prompt": True}
    return shrink(c, workdir, steps=steps)
