"""MT-GRPO: turn-level group advantages, outcome + turn rewards (SPEC §3).

    agentrl train --config configs/mt_grpo.py:tiny --config.workdir=/tmp/agentrl/mt_grpo
    agentrl train --config configs/mt_grpo.py:qwen2_5_7b --config.workdir=/ckpt/mt_grpo \\
        --config.model.hf_path=/models/Qwen2.5-7B

Seed: `turn_level_credit_mt_grpo_mt_ppo.txt` §3.3, App. C (method), App. D
(two-turn search environment, rewards D.2, hyperparameters D.3).

`arg` (grammar in configs/common.py): model `tiny` | `qwen2_5_7b`; engine
`jax` | `vllm`.

* `tiny`: CPU in minutes; `multihop_search` with one hop, so each rollout is
  the paper's two turns (search, then answer); SFT warm start, then MT-GRPO.
* `qwen2_5_7b`: App. D.3 (G = 21, lr 1e-6, β = 0, 2 iterations, 300 optimizer
  steps). The built-in `multihop_search` task (1 hop, top-1 result) stands in
  for TriviaQA + Wikipedia search unless `data.train_prompts` names a prompt file.

Every policy generation is one turn (`steps_are_turns`): MT-GRPO's turn is one
reasoning → action → observation round (SPEC §1). The turn rewards of App. D.2
(tool execution 0.2, search-result answer presence 0.5) and outcome rewards
(`agentrl.rewards.mt_grpo_*`) are not selected by any config field yet
(docs/training.md, "Open fields").
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {"model": ("tiny", "qwen2_5_7b"), "engine": common.ENGINES}
CHECKPOINTS = {"qwen2_5_7b": "Qwen2.5-7B"}  # App. D.3: Qwen2.5-7B as the base model


def get_config(arg: str = "tiny"):
    variant = common.parse_arg(arg, AXES)
    c = base_config()
    c.credit.scheme = "mt_grpo"
    c.credit.options = dict(scale="std", ddof=1, eps=1e-6)  # SPEC §1, §3
    c.rollout.loop = "tool"
    c.rollout.steps_are_turns = True  # one generation = one MT-GRPO turn (SPEC §1)
    c.rollout.max_steps = 2  # App. D.1/D.5: "Use the tool exactly once", then answer
    c.rollout.temperature = 1.0  # not stated
    c.rollout.top_p = 1.0  # not stated
    # D.5: one wiki_search call that "returns the top matching article".
    c.task.name = "multihop_search"
    c.task.options = dict(world_seed=0, max_hops=1, top_k=1, final_tool=False)
    if variant["model"] == "tiny":
        common.tiny(c)
        c.rollout.group_size = 8  # CPU size (the paper's G is 21)
    else:
        common.paper_model(c, variant["model"], CHECKPOINTS[variant["model"]])
        c.rollout.group_size = 21  # D.3: "number of rollout generations is set to 21"
        # D.3: per-device batch 12 × gradient accumulation 4 × 7 training GPUs
        # = 336 completions = 16 prompts × 21 per optimizer step.
        c.rollout.prompts_per_step = 16
        c.rollout.max_step_tokens = 1024  # D.3: maximum completion length 1024
        c.rollout.max_context_tokens = 4096  # not stated
        c.train.ppo_epochs = 2  # D.3: "Each batch undergoes two training iterations"
        c.train.num_minibatches = 1  # one optimizer step per iteration
        c.train.steps = 150  # D.3: 300 optimizer steps at 2 iterations per batch
        c.optim.actor.learning_rate = 1e-6  # D.3: "fixed at 1e-6"
        c.loss.kl_coef = 0.0  # D.3: "disabled by setting β=0"
        c.loss.clip_low = c.loss.clip_high = 0.2  # not stated (TRL default 0.2)
    common.engine(c, variant["engine"])
    return c
