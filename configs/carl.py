"""CARL: segment-level credit from a competence-aware critic on a shared backbone (SPEC §9).

    agentrl train --config configs/carl.py:tiny --config.workdir=/tmp/agentrl/carl
    agentrl train --config configs/carl.py:qwen2_5_7b --config.workdir=/ckpt/run1 \\
        --config.model.hf_path=/models/Qwen2.5-7B-Instruct
    agentrl train --config configs/carl.py:qwen2_5_3b,cold --config.workdir=/ckpt/carl3b_cold

Seed: `carl_segment_credit.txt` §3 (segments, advantages, critic), App. C
(warm-up and gate), App. D Table 5 (hyperparameters), App. H (warm-up
ablation).

`arg` (grammar in configs/common.py): model `tiny` | `qwen2_5_3b` |
`qwen2_5_7b` (Qwen2.5-{3B,7B}-Instruct); warmup `warm` (default: critic-only
warm-up, then the App. C gate) | `cold` (App. H's cold start: no warm-up);
engine `jax` | `vllm`. The λ ablation of App. H Table 10:
`--config.credit.options.lambda_=0.5`.

* `tiny`: CPU in minutes on `arithmetic` (easy sums from the weights, hard
  products through a Python block): SFT warm start, a short critic warm-up
  whose gate is reported but not enforced, then segment PPO.
* paper models: App. D Table 5: 256 prompts × 5 rollouts, 4 PPO epochs,
  mini-batch 64, clip 0.2, entropy 0.001, KL 0.001 (k3), c_v = 0.5, γ = 1,
  λ = 0, lrs 1e-6 (actor) / 5e-6 (value head) / 5e-7 (critic backbone) after a
  100-step linear warm-up, 500 steps, 15 segments (7 tool calls), 2048 + 2048
  tokens; the
  App. C gate (AUC 0.70, sign accuracy 0.60, EV 0.45). The built-in
  `arithmetic` task stands in for GSM8K / HotpotQA / 2WikiMQA / FinQA /
  Musique unless `data.train_prompts` names a prompt file; the four-bucket warm-up set of
  App. C and T_assimilate = 256 have no config field yet
  (docs/training.md, "Open fields").
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {
    "model": ("tiny", "qwen2_5_3b", "qwen2_5_7b"),
    "warmup": ("warm", "cold"),
    "engine": common.ENGINES,
}
CHECKPOINTS = {  # App. O: "Qwen2.5-7B-Instruct and Qwen2.5-3B-Instruct"
    "qwen2_5_3b": "Qwen2.5-3B-Instruct",
    "qwen2_5_7b": "Qwen2.5-7B-Instruct",
}
TINY_CRITIC_WARMUP_STEPS = 20  # CPU size; the gate is reported, not enforced


def get_config(arg: str = "tiny"):
    variant = common.parse_arg(arg, AXES)
    c = base_config()
    c.seed = 1  # Table 5: seeds {1, 2, 3}
    c.credit.scheme = "segment"
    c.credit.options = dict(
        gamma=1.0,  # Table 5: discount γ 1.0
        lambda_=0.0,  # Table 5: GAE λ 0.0 (one-step TD, §3.2)
    )
    c.value.mode = "shared"  # §3.3: value head on the shared LLM backbone
    c.value.head = "carl"  # Table 5: 2-layer MLP, GELU, sigmoid, zero-init final layer
    c.rollout.loop = "segment"
    c.rollout.group_size = 5  # Table 5: n_samples_per_prompt 5
    # Table 5: at most 15 segments per episode. K tool calls make 2K + 1 segments
    # (SPEC §9.1), and for loop="segment" max_steps counts tool calls.
    c.rollout.max_steps = 7
    c.rollout.temperature = 1.0  # Table 5: temperature 1.0
    c.rollout.top_p = 1.0  # Table 5: top-p 1.0
    c.rollout.top_k = 0  # Table 5: top-k −1 (off)
    c.task.name = "arithmetic"
    c.task.options = dict(hard_fraction=0.5, compact_prompt=False,  # CARL prompts: no schema
                          demo_tool_rate=1.0)
    c.loss.clip_low = c.loss.clip_high = 0.2  # Table 5: eps_clip 0.2
    c.loss.aggregation = "segment_mean_sum"  # SPEC §9.3 (the scheme's own)
    c.loss.value_coef = 0.5  # Table 5: vf_coef 0.5 (c_v, SPEC §9.3)
    c.loss.entropy_coef = 0.001  # Table 5: entropy coef 0.001
    c.loss.kl_coef = 0.001  # Table 5: init_kl_coef 0.001, as a loss term
    c.loss.kl_kind = "k3"  # Table 5: use_kl_estimator_k3
    c.warmup.auc = 0.70  # App. C gate: AUC of V(s0), Tier 2 vs Tier 1 ≥ 0.70
    c.warmup.sign_accuracy = 0.60  # App. C gate: ≥ 60 % correct sign after retrieval
    c.warmup.explained_variance = 0.45  # App. C gate: EV ≥ 0.45
    if variant["model"] == "tiny":
        common.tiny(c)
        c.rollout.max_context_tokens = 256  # CARL prompts carry no tool schema: ~65 + ~50 tokens
        c.optim.critic_backbone.learning_rate = c.optim.critic.learning_rate / 10  # §3.3: 10×
        c.warmup.steps = TINY_CRITIC_WARMUP_STEPS
        c.warmup.require_gate = False
    else:
        common.paper_model(c, variant["model"], CHECKPOINTS[variant["model"]])
        c.rollout.prompts_per_step = 256  # Table 5: rollout_batch_size 256
        # Table 5: train_batch_size (PPO mini-batch) 64 of the 1,280 trajectories.
        c.train.num_minibatches = common.num_minibatches(256 * 5, 64)
        c.train.ppo_epochs = 4  # Table 5: max_epochs 4
        c.train.steps = 500  # Table 5: num_episodes 500
        c.train.eval_every = 25  # Table 5: eval every 25 steps
        c.rollout.max_step_tokens = 2048  # Table 5: generate_max_len 2048
        c.rollout.max_context_tokens = 2048 + 2048  # Table 5: prompt_max_len + generate_max_len
        # Table 5: lrs constant after a 100-step linear warm-up; AdamW, grad clip 1.0,
        # weight decay 0.0 on the head, 0.01 on the backbone.
        c.optim.actor.learning_rate = 1e-6
        c.optim.actor.warmup_steps = 100
        c.optim.actor.weight_decay = 0.01
        c.optim.actor.clip_norm = 1.0
        c.optim.critic.learning_rate = 5e-6
        c.optim.critic.warmup_steps = 100
        c.optim.critic.weight_decay = 0.0
        c.optim.critic.clip_norm = 1.0
        c.optim.critic_backbone.learning_rate = 5e-7
        c.optim.critic_backbone.warmup_steps = 100
        c.optim.critic_backbone.weight_decay = 0.01
        c.optim.critic_backbone.clip_norm = 1.0
        c.warmup.steps = 2400  # Table 5: 1,800-2,400 critic warm-up steps (gate-passing)
        c.warmup.require_gate = True
    if variant["warmup"] == "cold":
        c.warmup.steps = 0  # App. H: "Cold start" uses no separate warm-up phase
    common.engine(c, variant["engine"])
    return c
