"""Dr. GRPO: GRPO without the std division, constant-length loss normalisation (SPEC §1-2).

    agentrl train --config configs/dr_grpo.py:tiny --config.workdir=/tmp/agentrl/dr_grpo
    agentrl train --config configs/dr_grpo.py:qwen2_5_7b --config.workdir=/ckpt/dr_grpo \\
        --config.model.hf_path=/models/Qwen2.5-7B

`arg`: the same as configs/grpo.py (model `tiny` | `qwen2_5_7b`; engine
`jax` | `vllm`). Everything is grpo.py's, so the two runs differ only in the
estimator: `scale="none"` (advantages are `R_i − mean_g R`, CM2 App. A.3's "standard
deviation term set to 1") and the `seq_mean_token_sum_norm` aggregation, whose
constant `norm_length` is the generation budget (`max_steps × max_step_tokens`).
Dr. GRPO's own paper settings are not in the seeds (docs/credit/grpo.md §5).
"""

from agentrl.train.config import load_sibling

grpo = load_sibling(__file__, "grpo.py")
AXES = grpo.AXES


def get_config(arg: str = "tiny"):
    c = grpo.get_config(arg)
    c.credit.scheme = "dr_grpo"
    c.credit.options = dict(scale="none", ddof=1, eps=1e-6)  # SPEC §1: divide by 1
    c.loss.aggregation = "seq_mean_token_sum_norm"  # SPEC §10; the scheme's default
    c.loss.norm_length = c.rollout.max_steps * c.rollout.max_step_tokens
    return c
