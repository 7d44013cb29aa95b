"""The embedded default: a tiny Qwen learns tool use on CPU in minutes, with no network.

    agentrl train --config configs/cpu_demo.py --config.workdir=/tmp/agentrl/cpu_demo
    taskset -c 0,1 launch/local.sh configs/cpu_demo.py     # pinned to 2 cores

A tiny random-init Qwen2-architecture model (3 layers of 128, compact
vocabulary of the bundled Qwen2.5 tokenizer) on the built-in `arithmetic`
task: easy one-digit sums it can answer directly (30%), hard three-by-two-digit
products it must send to the calculator tool (70%). An SFT warm start on the
task's demonstrations teaches the chat and tool-call format; only 35% of the
hard demonstrations call the calculator, so the warm-started policy under-uses it.
GRPO with the in-process JaxEngine then learns to call it, and held-out
success rises well above the SFT starting point (docs/benchmarks.md: 3 seeds,
wall time on 2 CPU cores).

`arg`: `tiny` (the only model; the default).
"""

from agentrl.train.config import base_config, load_sibling

common = load_sibling(__file__, "common.py")
AXES = {"model": ("tiny",)}

# Every number of the demo, in one place (tuned on the 2-core CPU; docs/benchmarks.md).
DEMO = dict(
    seed=0,
    hidden_size=128,         # tiny preset widened: 3 layers of 128, SwiGLU 384,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=8,   # 8 query / 4 key-value heads of 16: with 4 / 2 heads, some
    num_key_value_heads=4,   # seeds had not learnt to copy the tool result after 600 SFT steps
    hard_fraction=0.7,       # share of questions that need the calculator
    demo_tool_rate=0.35,     # share of hard demonstrations that call it (the rest answer
                             # directly), so the SFT policy under-uses the tool
    compact_prompt=True,     # short calculator schema in the system prompt
    train_size=2000,         # task instances for RL prompts
    eval_size=100,           # held-out instances for the eval success (greedy)
    sft_steps=900,           # SFT warm start (format, tool calls, copying the result)
    sft_batch_size=32,
    sft_learning_rate=1e-3,
    sft_demonstrations=2048,
    rl_steps=40,             # GRPO steps after SFT
    prompts_per_step=8,
    group_size=8,            # 8 × 8 = 64 trajectories per step
    max_steps=2,             # calculator call, then the boxed answer
    max_step_tokens=40,      # a calculator call is ~30 tokens
    max_context_tokens=256,
    engine_batch_size=64,    # rows per JaxEngine call (= all trajectories of a step)
    temperature=1.0,
    actor_learning_rate=3e-4,
    eval_every=10,
    checkpoint_every=10,
)


def get_config(arg: str = "tiny"):
    common.parse_arg(arg, AXES)  # only validates: there is one variant
    c = base_config()
    c.seed = DEMO["seed"]
    c.model.name = "tiny"
    c.model.hf_path = ""
    c.model.dtype = "float32"
    c.model.remat = "dots_no_batch"
    c.model.lora.rank = 0
    c.model.compact_vocab = True  # only the ids the task's texts use: a 151,665-way
    # output layer would cost 20x the update time of the tiny model itself
    c.model.overrides = dict(hidden_size=DEMO["hidden_size"],
                             intermediate_size=DEMO["intermediate_size"],
                             num_hidden_layers=DEMO["num_hidden_layers"],
                             num_attention_heads=DEMO["num_attention_heads"],
                             num_key_value_heads=DEMO["num_key_value_heads"],
                             max_position_embeddings=512)
    c.tokenizer = "qwen2.5"  # bundled with agentrl
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1  # one CPU device
    c.task.name = "arithmetic"
    c.task.options = dict(hard_fraction=DEMO["hard_fraction"],
                          compact_prompt=DEMO["compact_prompt"],
                          demo_tool_rate=DEMO["demo_tool_rate"])
    c.task.train_size = DEMO["train_size"]
    c.task.eval_size = DEMO["eval_size"]
    c.sft.steps = DEMO["sft_steps"]
    c.sft.batch_size = DEMO["sft_batch_size"]
    c.sft.learning_rate = DEMO["sft_learning_rate"]
    c.sft.demonstrations = DEMO["sft_demonstrations"]
    c.credit.scheme = "grpo"
    c.credit.options = dict(scale="std", ddof=1, eps=1e-6)
    c.rollout.loop = "tool"
    c.rollout.engine = "jax"
    c.rollout.prompts_per_step = DEMO["prompts_per_step"]
    c.rollout.group_size = DEMO["group_size"]
    c.rollout.max_steps = DEMO["max_steps"]
    c.rollout.max_step_tokens = DEMO["max_step_tokens"]
    c.rollout.max_context_tokens = DEMO["max_context_tokens"]
    c.rollout.max_batch_size = DEMO["engine_batch_size"]
    c.rollout.temperature = DEMO["temperature"]
    c.optim.actor.learning_rate = DEMO["actor_learning_rate"]
    c.loss.kl_coef = 0.0
    c.train.steps = DEMO["rl_steps"]
    c.train.eval_every = DEMO["eval_every"]
    c.train.checkpoint_every = DEMO["checkpoint_every"]
    c.train.log_every = 1
    return c
