"""agentrl: reinforcement learning of tool-using LLM agents in JAX/Flax.

Subpackages: `agentrl.credit` (credit-assignment schemes, SPEC §2-9),
`agentrl.losses` (SPEC §10), `agentrl.rewards` (rule-based rewards, SPEC §4,
§6.4, §7), `agentrl.types` (Trajectory, Batch).
"""

__version__ = "0.1.0"
