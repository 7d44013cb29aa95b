"""The training configuration: defaults, validation, and the objects built from it.

Every experiment file in `configs/` starts from `base_config()` and changes
fields; `validate(config)` checks the whole config before any compute and
names the bad field, its value and the fix. Field reference (defaults below):

* `workdir`, `seed`.
* `model`: `name` (a preset of `agentrl.models.model_config`) or `hf_path` (an
  HF checkpoint directory), `dtype`, `remat`, `overrides` (architecture fields
  of the preset to change), `compact_vocab` (renumber the tokenizer to the ids
  the task uses: `agentrl.models.tokenizer.CompactTokenizer`, for tiny CPU
  models; random init only), `lora` (`rank` 0 = full fine-tuning, `alpha`,
  `dropout`, `targets`).
* `tokenizer`: `"qwen2.5"`, `"qwen3"` or a checkpoint directory.
* `mesh`: `data`, `fsdp`, `tensor` sizes (one may be -1).
* `task`: `name` (a built-in task: its tools and reward), `options`,
  `train_size`, `eval_size`.
* `data`: `train_prompts` / `eval_prompts`: JSONL or ArrayRecord prompt files
  (`agentrl.data.prompts`) replacing the task's generated instances; "" uses
  the task's.
* `rollout`: `loop` (`tool` | `dialogue` | `tree` | `segment`), `engine`
  (`jax` | `vllm`, `vllm_urls`), `prompts_per_step`, `group_size`,
  `max_steps`, `max_step_tokens`, `max_context_tokens`, sampling
  (`temperature`, `top_p`, `top_k`), `tree_n`, `tree_forks`, `steps_are_turns`.
* `credit`: `scheme` (registry name), `options`, `transform` (None | `vspo`),
  `transform_options`.
* `value`: `mode` (`none` | `shared` | `separate`), `head` (`linear` | `carl`).
* `loss`: PPO clip, aggregation (None: the scheme's), KL, entropy, value loss,
  truncated IS (SPEC §10).
* `optim`: per channel (`actor`, `critic`, `critic_backbone`) learning rate,
  warm-up, weight decay, clipping.
* `train`: `steps`, `ppo_epochs`, `num_minibatches`, `eval_every`,
  `log_every`, `checkpoint_every`, `keep_checkpoints`, `export_hf`.
* `sft`: cold-start SFT (`steps` 0 disables it), `batch_size`,
  `learning_rate`, `warmup_steps`, `schedule` (`constant` | `cosine`: decay
  to 0 by the last step, as HF's and LLaMA-Factory's cosine), `demonstrations`.
* `warmup`: CARL critic-only warm-up (`steps` 0 disables it) and its gate
  (SPEC §9.4: `auc` 0.70, `sign_accuracy` 0.60, `explained_variance` 0.45;
  `require_gate`).
* `async_rollout`: `enabled`, `shard_dir`, `max_staleness`, `workers`.
"""

import importlib.util
import pathlib

import ml_collections

from agentrl import credit, losses
from agentrl.envs.tasks import available_tasks
from agentrl.models.config import PRESETS, REMAT_POLICIES
from agentrl.models.qwen import LORA_TARGETS

LOOPS = ("tool", "dialogue", "tree", "segment")
ENGINES = ("jax", "vllm")
VALUE_MODES = ("none", "shared", "separate")
HEADS = ("linear", "carl")


def optimizer(learning_rate: float, *, warmup_steps: int = 0, weight_decay: float = 0.0,
              clip_norm: float = 1.0) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        learning_rate=learning_rate, warmup_steps=warmup_steps, weight_decay=weight_decay,
        clip_norm=clip_norm))


def base_config() -> ml_collections.ConfigDict:
    """Defaults of every field; experiment files override them."""
    c = ml_collections.ConfigDict()
    c.workdir = "/tmp/agentrl"
    c.seed = 0
    c.model = ml_collections.ConfigDict(dict(
        name="tiny", hf_path="", dtype="float32", remat="none", overrides={},
        compact_vocab=False,
        lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0,
                                            targets=tuple(LORA_TARGETS)))))
    c.tokenizer = "qwen2.5"
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.task = ml_collections.ConfigDict(dict(name="arithmetic", options={}, train_size=2000,
                                            eval_size=100))
    c.data = ml_collections.ConfigDict(dict(train_prompts="", eval_prompts=""))
    c.rollout = ml_collections.ConfigDict(dict(
        loop="tool", engine="jax", vllm_urls=(), vllm_model="", prompts_per_step=8,
        group_size=8, max_steps=4, max_step_tokens=64, max_context_tokens=512,
        temperature=1.0, top_p=1.0, top_k=0, tree_n=8, tree_forks=0, steps_are_turns=False,
        max_batch_size=64, final_answer_tool=""))
    c.credit = ml_collections.ConfigDict(dict(scheme="grpo", options={}, transform="",
                                              transform_options={}))
    c.value = ml_collections.ConfigDict(dict(mode="none", head="linear"))
    c.loss = ml_collections.ConfigDict(dict(
        clip_low=0.2, clip_high=0.2, dual_clip=0.0, aggregation="", norm_length=0,
        kl_coef=0.0, kl_kind="k3", entropy_coef=0.0, value_coef=0.5, value_clip=0.0,
        tis_cap=0.0))
    c.optim = ml_collections.ConfigDict(dict(
        actor=optimizer(1e-6), critic=optimizer(5e-6), critic_backbone=optimizer(0.0)))
    c.train = ml_collections.ConfigDict(dict(
        steps=100, ppo_epochs=1, num_minibatches=1, eval_every=0, log_every=1,
        checkpoint_every=50, keep_checkpoints=3, export_hf=False))
    c.sft = ml_collections.ConfigDict(dict(steps=0, batch_size=16, learning_rate=1e-3,
                                           warmup_steps=0, schedule="constant",
                                           demonstrations=512))
    c.warmup = ml_collections.ConfigDict(dict(steps=0, auc=0.70, sign_accuracy=0.60,
                                              explained_variance=0.45, require_gate=True,
                                              holdout_fraction=0.2))
    c.async_rollout = ml_collections.ConfigDict(dict(enabled=False, shard_dir="",
                                                     max_staleness=2, workers=1))
    return c


def load_sibling(config_file: str, name: str):
    """Loads `name` from the directory of `config_file` as a module.

    ml-collections loads config files by path, not as a package, so a config
    reaches its siblings (`common.py`, another config) through this:
    `common = load_sibling(__file__, "common.py")`.
    """
    path = pathlib.Path(config_file).with_name(name)
    spec = importlib.util.spec_from_file_location(f"agentrl_configs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error(field: str, value, fix: str) -> ValueError:
    return ValueError(f"config.{field}={value!r} is invalid: {fix}")


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises a ValueError naming the first bad field; call before any compute."""
    checks = [
        ("model.name", c.model.name, c.model.hf_path or c.model.name in PRESETS,
         f"use a preset {sorted(PRESETS)} or set model.hf_path"),
        ("model.dtype", c.model.dtype, c.model.dtype in ("float32", "bfloat16"),
         "use 'float32' or 'bfloat16'"),
        ("model.remat", c.model.remat, c.model.remat in REMAT_POLICIES,
         f"use one of {REMAT_POLICIES}"),
        ("model.lora.rank", c.model.lora.rank, c.model.lora.rank >= 0, "use 0 (off) or a rank"),
        ("model.compact_vocab", c.model.compact_vocab,
         not (c.model.compact_vocab and c.model.hf_path),
         "a pretrained checkpoint keeps its vocabulary; set compact_vocab=False"),
        ("train.export_hf", c.train.export_hf,
         not (c.train.export_hf and c.model.compact_vocab),
         "a compact-vocabulary model has no HF tokenizer to export with; set "
         "model.compact_vocab=False or train.export_hf=False"),
        ("rollout.engine", c.rollout.engine,
         not (c.rollout.engine == "vllm" and c.model.compact_vocab),
         "vLLM serves HF exports, which a compact-vocabulary model cannot make; set "
         "model.compact_vocab=False or rollout.engine='jax'"),
        ("task.name", c.task.name, c.task.name in available_tasks(),
         f"use one of {available_tasks()}"),
        ("rollout.loop", c.rollout.loop, c.rollout.loop in LOOPS, f"use one of {LOOPS}"),
        ("rollout.engine", c.rollout.engine, c.rollout.engine in ENGINES,
         f"use one of {ENGINES}"),
        ("rollout.vllm_urls", c.rollout.vllm_urls,
         c.rollout.engine != "vllm" or len(c.rollout.vllm_urls) > 0,
         "list the vLLM servers' base URLs for engine='vllm'"),
        ("rollout.group_size", c.rollout.group_size, c.rollout.group_size >= 1, "use >= 1"),
        ("rollout.prompts_per_step", c.rollout.prompts_per_step,
         c.rollout.prompts_per_step >= 1, "use >= 1"),
        ("credit.scheme", c.credit.scheme, c.credit.scheme in credit.available_schemes(),
         f"use one of {credit.available_schemes()}"),
        ("credit.transform", c.credit.transform,
         c.credit.transform in ("", *credit.available_transforms()),
         f"use '' or one of {credit.available_transforms()}"),
        ("value.mode", c.value.mode, c.value.mode in VALUE_MODES, f"use one of {VALUE_MODES}"),
        ("value.head", c.value.head, c.value.head in HEADS, f"use one of {HEADS}"),
        ("loss.aggregation", c.loss.aggregation,
         c.loss.aggregation in ("", *losses.AGGREGATIONS),
         f"use '' (the scheme's) or one of {losses.AGGREGATIONS}"),
        ("loss.kl_kind", c.loss.kl_kind, c.loss.kl_kind in losses.KL_KINDS,
         f"use one of {losses.KL_KINDS}"),
        ("train.steps", c.train.steps, c.train.steps >= 0, "use >= 0"),
        ("train.num_minibatches", c.train.num_minibatches,
         (c.rollout.prompts_per_step * c.rollout.group_size) % max(c.train.num_minibatches, 1)
         == 0 and c.train.num_minibatches >= 1,
         "make prompts_per_step × group_size a multiple of it"),
        ("sft.steps", c.sft.steps, c.sft.steps >= 0, "use >= 0"),
        ("sft.warmup_steps", c.sft.warmup_steps,
         c.sft.warmup_steps >= 0 and (c.sft.steps == 0 or c.sft.warmup_steps < c.sft.steps),
         "use 0 <= warmup_steps < sft.steps"),
        ("sft.schedule", c.sft.schedule, c.sft.schedule in ("constant", "cosine"),
         "use 'constant' or 'cosine'"),
    ]
    for field in ("train_prompts", "eval_prompts"):
        path = c.data[field]
        suffixes = (".jsonl", ".json", ".array_record", ".arrayrecord")
        checks.append((f"data.{field}", path,
                       not path or (pathlib.Path(path).is_file() and path.endswith(suffixes)),
                       f"give an existing prompt file ending in {suffixes}, or '' for the task's"))
    for field, value, ok, fix in checks:
        if not ok:
            raise _error(field, value, fix)
    scheme = credit.get_scheme(c.credit.scheme)
    unknown = sorted(set(c.credit.options) - set(scheme.options))
    if unknown:
        raise _error("credit.options", dict(c.credit.options),
                     f"{c.credit.scheme!r} has no options {unknown}; its options are "
                     f"{dict(scheme.options)}")
    needs = scheme.needs_values
    if needs != "none" and c.value.mode == "none":
        raise _error("value.mode", c.value.mode,
                     f"scheme {c.credit.scheme!r} needs critic values at {needs!r} positions; "
                     "set value.mode to 'shared' or 'separate'")
    loops_for = {"tree": ("tree",), "segment": ("segment",), "checklist": ("dialogue",)}
    if c.credit.scheme in loops_for and c.rollout.loop not in loops_for[c.credit.scheme]:
        raise _error("rollout.loop", c.rollout.loop,
                     f"scheme {c.credit.scheme!r} needs rollout.loop in "
                     f"{loops_for[c.credit.scheme]}")
    if c.rollout.loop == "dialogue" and c.task.name != "multiturn_tools":
        raise _error("task.name", c.task.name,
                     "rollout.loop='dialogue' needs a dialogue task ('multiturn_tools')")


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()
                ) -> ml_collections.ConfigDict:
    """Loads `path/to/file.py[:arg]` (its `get_config(arg)`), applies overrides, locks it.

    The big_vision loader: ml-collections' `config_flags` on a private
    `FlagValues`, so `--config.a.b=value` overrides are parsed by the field's
    type, tuple fields take repeated flags, and a misspelled field fails with
    a "Did you mean" suggestion.
    """
    from absl import flags
    from ml_collections import config_flags

    path = spec.partition(":")[0]
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist (from --config {spec!r}).")
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise ValueError(f"overrides {bad} must look like --config.field=value.")
    argv = ["agentrl", f"--config={spec}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", default=None, flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
    except flags.Error as err:
        raise ValueError(str(err)) from None
    return flag_values.config
