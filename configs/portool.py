"""PORTool: rewarded tree rollouts, fork-relative + trajectory-relative advantages (SPEC §6).

    agentrl train --config configs/portool.py:tiny --config.workdir=/tmp/agentrl/portool
    agentrl train --config configs/portool.py:qwen2_5_7b --config.workdir=/ckpt/portool \\
        --config.model.hf_path=/models/Qwen2.5-7B-Instruct
    agentrl train --config configs/portool.py:qwen3_1_7b,avg,traj_only --config.workdir=/ckpt/p2

Seed: `portool_rewarded_tree.txt` §3.2 (tree rollout, step reward, advantages,
Theorem 3.1), §4.1 (setup), §4.3 (ablations), App. A (Algorithm 1), App. C.2
and Table 2 (hyperparameters).

`arg` (grammar in configs/common.py), every axis is one of the paper's
ablations:

* model `tiny` | `qwen2_5_7b` (Qwen-2.5-7B-Instruct) | `qwen3_1_7b` (Qwen-3-1.7B);
* rule `portool` (default: max, ties averaged) | `max` | `avg` | `mix2`
  (step-reward rule G of eq. 2, §4.3.3, SPEC §6.2);
* weighting `theorem` (default: w1 = 1, w2 from Theorem 3.1) | `traj_only`
  (w2 = 0) | `fork_only` (w1 = 0) | `no_scale` (w1 = w2 = 1) (§4.3.2, SPEC §6.3);
* engine `jax` | `vllm`.

The γ ablation of §4.3.1 (0, 0.9, 0.95, 1): `--config.credit.options.gamma=0.9`.

* `tiny`: CPU in minutes on `multihop_search` with the `response_gen` final
  tool; n = 8 tree rollouts; full fine-tuning (a random tiny model has
  nothing for LoRA to adapt).
* paper models: n = 8, γ = 0.95, format range ±0.25, no KL, LoRA r = 16,
  α = 8, lr 1e-6, batch 512 with PPO mini-batch 128, 100 steps (20 epochs).
  The built-in `multihop_search` task stands in for the paper's 17-tool
  dataset unless `data.train_prompts` names a prompt file; the evaluation agent that gives
  R_out (GPT-4o, §4.1) and the format score's tool-call success have no config
  field yet (docs/training.md, "Open fields"). The paper
  runs five epochs of SFT first (App. C.2): start from that checkpoint
  (`model.hf_path`) or set `--config.sft.steps`.
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {
    "model": ("tiny", "qwen2_5_7b", "qwen3_1_7b"),
    "rule": ("portool", "max", "avg", "mix2"),
    "weighting": ("theorem", "traj_only", "fork_only", "no_scale"),
    "engine": common.ENGINES,
}
CHECKPOINTS = {  # §4.1: "two base models: Qwen-2.5-7B-Instruct and Qwen-3-1.7B"
    "qwen2_5_7b": "Qwen2.5-7B-Instruct",
    "qwen3_1_7b": "Qwen3-1.7B",
}
ROLLOUTS = 8  # §4.1, App. C.2, Table 2: "eight rollouts are generated per query"


def get_config(arg: str = "tiny"):
    variant = common.parse_arg(arg, AXES)
    c = base_config()
    c.credit.scheme = "tree"
    c.credit.options = dict(
        gamma=0.95,  # §4.3.1: best of γ ∈ {0, 0.9, 0.95, 1}
        fmt_bound=0.25,  # §3.2: formatting reward rescaled to [−0.25, 0.25]
        rule=variant["rule"],
        weighting=variant["weighting"],
        scale="std",  # eq. 3: norm(·) is the z-score
        ddof=1,
        eps=1e-6,
    )
    c.rollout.loop = "tree"
    c.rollout.tree_n = ROLLOUTS
    c.rollout.group_size = ROLLOUTS  # one group = the n trajectories of a query's tree
    c.rollout.tree_forks = 0  # 0: f = n (the branching factor f is not stated)
    c.rollout.final_answer_tool = "response_gen"  # Algorithm 1: ISCOMPLETED
    c.rollout.max_steps = 5  # §3.2: T_max = 5 (evaluation caps at six steps, §4.1)
    c.rollout.temperature = 1.0  # App. C.2: temperature 1.0 in training
    c.rollout.top_p = 1.0  # App. C.2: top-p 1.0
    c.rollout.top_k = 0  # App. C.2: top-k −1 (off)
    c.task.name = "multihop_search"
    c.task.options = dict(world_seed=0, max_hops=3, top_k=2, final_tool=True)
    c.loss.kl_coef = 0.0  # §3.1, Table 2: "KL Loss Used: False"
    if variant["model"] == "tiny":
        common.tiny(c)
        c.rollout.max_context_tokens = 1024  # 3 hops + response_gen: demonstrations ~610
    else:
        common.paper_model(c, variant["model"], CHECKPOINTS[variant["model"]])
        c.model.lora.rank = 16  # App. C.2: "LoRA ... with rank = 16"
        c.model.lora.alpha = 8.0  # App. C.2: "and α = 8"
        c.rollout.prompts_per_step = 512  # Table 2: train batch size 512 (queries)
        # Table 2: PPO mini-batch 128 queries = 128 × 8 trajectories.
        c.train.num_minibatches = common.num_minibatches(512 * ROLLOUTS, 128 * ROLLOUTS)
        c.train.steps = 100  # App. C.2: "20 epochs (equivalent to 100 steps in total)"
        c.rollout.max_step_tokens = 2048  # C.2: "Each reasoning step is capped at 2,048"
        # Table 2: max prompt length (total) 30,720, plus the step being generated.
        c.rollout.max_context_tokens = 30720 + 2048
        c.optim.actor.learning_rate = 1e-6  # Table 2: learning rate 1e-6
        c.loss.clip_low = c.loss.clip_high = 0.2  # not stated (verl default 0.2)
    common.engine(c, variant["engine"])
    return c
