"""MT-PPO: turn rewards at turn ends, token-level GAE with γ = λ = 1 (SPEC §4).

    agentrl train --config configs/mt_ppo.py:tiny --config.workdir=/tmp/agentrl/mt_ppo
    agentrl train --config configs/mt_ppo.py:qwen2_5_7b --config.workdir=/ckpt/mt_ppo \\
        --config.model.hf_path=/models/Qwen2.5-7B
    agentrl train --config configs/mt_ppo.py:qwen2_5_7b,ppo --config.workdir=/ckpt/ppo

Seed: `turn_level_credit_mt_grpo_mt_ppo.txt` §4, §5.2 (rewards), §6.1 and
App. B.2 (Search-R1 setup and hyperparameters).

`arg` (grammar in configs/common.py): model `tiny` | `qwen2_5_7b`; credit
`mt_ppo` (default) | `ppo` (the paper's baseline: the outcome reward only,
token-level GAE, same γ = λ = 1 and everything else equal); engine `jax` |
`vllm`.

* `tiny`: CPU in minutes on `multihop_search` (1-3 hops, a turn per search),
  a separate tiny critic.
* `qwen2_5_7b`: App. B.2 (Search-R1 codebase): policy / critic lr 1e-6 / 1e-5,
  warm-up ratios 0.285 / 0.015, batch 512 with mini-batch 256, 500 steps, KL
  0.001, clip 0.2, up to 4 turns, 3 retrieved passages, response 500 tokens,
  sequence 4096. The built-in `multihop_search` task stands in for NQ +
  HotpotQA over Wikipedia (E5) unless `data.train_prompts` names a prompt file.

The §5.2 reward components (`agentrl.rewards.mt_ppo_*`: EM, format, retrieval,
search penalty) are not selected by any config field yet, and neither is the
500-token cap on retrieved content (docs/training.md, "Open
fields").
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {"model": ("tiny", "qwen2_5_7b"), "credit": ("mt_ppo", "ppo"), "engine": common.ENGINES}
CHECKPOINTS = {"qwen2_5_7b": "Qwen2.5-7B"}  # §6.1: "We use Qwen2.5-7B ... as the base model"
PAPER_STEPS = 500  # App. B.2: "Training is performed for 500 steps"


def get_config(arg: str = "tiny"):
    variant = common.parse_arg(arg, AXES)
    c = base_config()
    # App. B.2: "We adopt GAE with λ = 1 and γ = 1" (both methods). Whitening
    # is not stated; it is off for both so the two differ only in the rewards.
    c.credit.scheme = "mt_ppo" if variant["credit"] == "mt_ppo" else "gae"
    c.credit.options = dict(gamma=1.0, lambda_=1.0, whiten=False)
    c.value.mode = "separate"  # PPO's critic is its own model (Search-R1 / verl)
    c.value.head = "linear"
    c.rollout.loop = "tool"
    c.rollout.steps_are_turns = True  # a turn = one search round (§5.2)
    c.rollout.temperature = 1.0  # App. B.2: temperature 1.0
    c.rollout.top_p = 1.0  # App. B.2: top-p 1.0
    c.task.name = "multihop_search"
    c.task.options = dict(world_seed=0, max_hops=3, top_k=3, final_tool=False)  # B.2: 3 passages
    c.loss.clip_low = c.loss.clip_high = 0.2  # App. B.2: clipping ratio 0.2
    c.loss.kl_coef = 0.001  # App. B.2: β = 0.001
    c.loss.kl_kind = "k3"  # not stated; Search-R1 PPO's low_var_kl (CARL seed Table 5)
    c.loss.entropy_coef = 0.001  # not stated; Search-R1 PPO's value (CARL seed Table 5)
    c.loss.value_coef = 0.5  # not stated; Search-R1 PPO's vf_coef (CARL seed Table 5)
    c.rollout.max_steps = 4  # App. B.2: "the maximum turns to 4"
    if variant["model"] == "tiny":
        common.tiny(c)
        c.rollout.group_size = 4  # PPO needs no groups; 4 prompts × 4 = 16 trajectories
        c.rollout.max_context_tokens = 1024  # 3 hops × 3 passages: demonstrations reach ~530
    else:
        common.paper_model(c, variant["model"], CHECKPOINTS[variant["model"]])
        c.rollout.group_size = 1  # Search-R1 PPO samples one response per prompt
        c.rollout.prompts_per_step = 512  # App. B.2: "total batch size is 512"
        c.train.num_minibatches = common.num_minibatches(512, 256)  # B.2: mini-batch 256
        # App. B.2: "500 steps over 4 epochs". Read as 4 PPO epochs per step:
        # 500 × 512 prompts is ~1.5 passes over NQ + HotpotQA (~170K), not 4.
        c.train.ppo_epochs = 4
        c.train.steps = PAPER_STEPS
        c.rollout.max_step_tokens = 500  # App. B.2: maximum response length 500
        c.rollout.max_context_tokens = 4096  # App. B.2: maximum sequence length 4,096
        c.optim.actor.learning_rate = 1e-6  # App. B.2: policy lr 1e-6
        c.optim.actor.warmup_steps = int(0.285 * PAPER_STEPS)  # B.2: warm-up ratio 0.285
        c.optim.critic.learning_rate = 1e-5  # App. B.2: critic lr 1e-5
        c.optim.critic.warmup_steps = int(0.015 * PAPER_STEPS)  # B.2: warm-up ratio 0.015
    common.engine(c, variant["engine"])
    return c
