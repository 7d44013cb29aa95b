"""Credit assignment: every scheme of the five papers as pure jittable functions.

Shapes and maths follow `SPEC.md` §1-§9; the public names below are the API
contract of `DESIGN.md`. Schemes are looked up by name through the registry
(`get_scheme("tree")`); add one with `@register_scheme`.
"""

from agentrl.credit.broadcast import (
    first_step_of_turns,
    last_token_positions,
    step_token_counts,
    steps_to_tokens,
    trajectory_to_tokens,
    turn_steps_to_tokens,
    turns_to_tokens,
    units_to_tokens,
)
from agentrl.credit.checklist import ChecklistCredit, checklist_credit, checklist_step_rewards
from agentrl.credit.gae import (
    gae_advantages,
    mt_ppo_token_rewards,
    next_policy_values,
    reverse_linear_recurrence,
    whiten_advantages,
)
from agentrl.credit.grpo import grpo_advantages, mt_grpo_advantages
from agentrl.credit.registry import (
    BatchTransform,
    CreditOutput,
    CreditScheme,
    available_schemes,
    available_transforms,
    compute_credit,
    get_scheme,
    get_transform,
    register_scheme,
    register_transform,
    unregister_scheme,
)
from agentrl.credit.segment import segment_advantages, segment_critic_loss
from agentrl.credit.tree import TreeCredit, tree_credit
from agentrl.credit.vspo import (
    vspo_probabilities,
    vspo_resample,
    vspo_slot_weights,
    vspo_value_scores,
)

__all__ = [
    "BatchTransform",
    "ChecklistCredit",
    "CreditOutput",
    "CreditScheme",
    "TreeCredit",
    "available_schemes",
    "available_transforms",
    "checklist_credit",
    "checklist_step_rewards",
    "compute_credit",
    "first_step_of_turns",
    "gae_advantages",
    "get_scheme",
    "get_transform",
    "grpo_advantages",
    "last_token_positions",
    "mt_grpo_advantages",
    "mt_ppo_token_rewards",
    "next_policy_values",
    "register_scheme",
    "register_transform",
    "reverse_linear_recurrence",
    "segment_advantages",
    "segment_critic_loss",
    "step_token_counts",
    "steps_to_tokens",
    "trajectory_to_tokens",
    "tree_credit",
    "turn_steps_to_tokens",
    "turns_to_tokens",
    "units_to_tokens",
    "unregister_scheme",
    "vspo_probabilities",
    "vspo_resample",
    "vspo_slot_weights",
    "vspo_value_scores",
    "whiten_advantages",
]
