"""GRPO: the group-normalised trajectory reward every seed paper compares against (SPEC §2).

    agentrl train --config configs/grpo.py:tiny --config.workdir=/tmp/agentrl/grpo
    agentrl train --config configs/grpo.py:qwen2_5_7b --config.workdir=/ckpt/grpo \\
        --config.model.hf_path=/models/Qwen2.5-7B

`arg` (grammar in configs/common.py): model `tiny` | `qwen2_5_7b`; engine
`jax` | `vllm`.

* `tiny`: CPU in minutes. Tiny Qwen2, SFT warm start on the `arithmetic`
  task's demonstrations (calculator for hard products), then GRPO.
* `qwen2_5_7b`: the GRPO baseline of the MT-GRPO seed
  (`turn_level_credit_mt_grpo_mt_ppo.txt` App. D.3, "GRPO-OR": outcome reward
  only, trajectory-level advantage): Qwen2.5-7B (base), one search then an
  answer, G = 21, lr 1e-6, no KL, two iterations per batch. The built-in
  `multihop_search` task (1 hop, top-1 result) stands in for TriviaQA +
  Wikipedia search unless `data.train_prompts` names a prompt file (see
  docs/training.md, "Datasets").

Numbers without a source are marked "not stated" (our choice).
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {"model": ("tiny", "qwen2_5_7b"), "engine": common.ENGINES}
CHECKPOINTS = {"qwen2_5_7b": "Qwen2.5-7B"}  # App. D.3: "Qwen2.5-7B ... as the base model"


def get_config(arg: str = "tiny"):
    variant = common.parse_arg(arg, AXES)
    c = base_config()
    c.credit.scheme = "grpo"
    c.credit.options = dict(scale="std", ddof=1, eps=1e-6)  # SPEC §1-2
    c.rollout.loop = "tool"
    c.rollout.temperature = 1.0  # not stated
    c.rollout.top_p = 1.0  # not stated
    if variant["model"] == "tiny":
        common.tiny(c)
        c.task.name = "arithmetic"
        c.task.options = dict(hard_fraction=0.5, compact_prompt=True,  # ~174 prompt tokens
                              demo_tool_rate=1.0)
        c.rollout.group_size = 8
        c.rollout.max_steps = 2  # calculator call, then the boxed answer
        c.rollout.max_context_tokens = 320  # prompt + two steps of 48 + the result
    else:
        common.paper_model(c, variant["model"], CHECKPOINTS[variant["model"]])
        c.task.name = "multihop_search"
        # D.5: one wiki_search call that "returns the top matching article".
        c.task.options = dict(world_seed=0, max_hops=1, top_k=1, final_tool=False)
        c.rollout.group_size = 21  # D.3: "number of rollout generations is set to 21"
        # D.3: per-device batch 12 × gradient accumulation 4 × 7 training GPUs
        # = 336 completions = 16 prompts × 21 per optimizer step.
        c.rollout.prompts_per_step = 16
        c.rollout.max_steps = 2  # D.2/D.5: reasoning → search → result → answer
        c.rollout.max_step_tokens = 1024  # D.3: maximum completion length 1024
        c.rollout.max_context_tokens = 4096  # not stated
        c.train.ppo_epochs = 2  # D.3: "Each batch undergoes two training iterations"
        c.train.num_minibatches = 1  # one optimizer step per iteration (D.3)
        # D.3: 300 training (optimizer) steps at 2 iterations per batch = 150 batches.
        c.train.steps = 150
        c.optim.actor.learning_rate = 1e-6  # D.3: "fixed at 1e-6"
        c.loss.kl_coef = 0.0  # D.3: "KL divergence penalty is disabled by setting β=0"
        c.loss.clip_low = c.loss.clip_high = 0.2  # not stated (TRL default 0.2)
    common.engine(c, variant["engine"])
    return c
