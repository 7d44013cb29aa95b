"""The experiment configs (configs/*.py) and launch scripts (launch/*).

Every config file × every variant of its `arg` grammar loads the way the CLI
loads it (`--config FILE.py:ARG --config.x=v`, ml-collections' config_flags,
locked), passes `validate`, takes overrides and rejects misspelled ones; its
docstring's launch commands load; the papers' key numbers are SPEC's; the
launch scripts are `bash -n` clean and print the expected commands in
DRY_RUN mode.
"""

import ast
import importlib.util
import inspect
import itertools
import os
import pathlib
import re
import shlex
import subprocess
import tempfile

import pytest

from agentrl import credit
from agentrl.envs.tasks import get_task
from agentrl.models import get_tokenizer
from agentrl.models.config import PRESETS
from agentrl.train.config import load_config, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ["grpo", "dr_grpo", "mt_grpo", "mt_ppo", "cm2", "portool", "prs_vspo", "carl",
           "cpu_demo"]
NOT_TRAINING_CONFIGS = {"common.py", "plan_qwen2_5_7b.py"}
LAUNCH = ["local.sh", "slurm.sbatch", "vllm_servers.sh", "rollout_workers.sh"]
# config_flags loads config files with importlib's deprecated load_module().
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")


def module(name: str):
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"test_configs_{name}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def variants(name: str) -> list[str]:
    """Every combination of the file's axes, as `arg` strings."""
    axes = module(name).AXES
    return [",".join(combo) for combo in itertools.product(*axes.values())]


ALL_VARIANTS = [(name, arg) for name in CONFIGS for arg in variants(name)]



def paper(name: str, arg: str) -> bool:
    return arg.split(",")[0] != "tiny"


# -- loading --------------------------------------------------------------------------------


def test_every_config_file_is_listed():
    files = {p.name for p in (ROOT / "configs").glob("*.py")}
    assert files - NOT_TRAINING_CONFIGS == {f"{name}.py" for name in CONFIGS}


@pytest.mark.parametrize("name,arg", ALL_VARIANTS, ids=[f"{n}:{a}" for n, a in ALL_VARIANTS])
def test_every_variant_loads_locked_and_validates(name, arg):
    config = load_config(f"configs/{name}.py:{arg}")
    validate(config)
    assert config.is_locked
    with pytest.raises(AttributeError):
        config.train.not_a_field = 1
    if paper(name, arg):
        assert config.model.name in PRESETS
        assert config.model.hf_path.startswith("/")
        assert config.model.dtype == "bfloat16"
    else:
        assert config.model.name == "tiny" and config.model.hf_path == ""
        assert config.tokenizer == "qwen2.5"
        if config.rollout.engine == "vllm":  # vLLM needs HF ids: the full, trimmed vocabulary
            assert not config.model.compact_vocab
            assert config.model.overrides.vocab_size == get_tokenizer("qwen2.5").vocab_size
        else:
            assert config.model.compact_vocab
        assert config.sft.steps > 0  # a random tiny model needs the warm start


@pytest.mark.parametrize("name", CONFIGS)
def test_default_arg_is_tiny(name):
    config = load_config(f"configs/{name}.py")
    assert config.model.name == "tiny"
    assert config.rollout.engine == "jax"
    assert config == load_config(f"configs/{name}.py:tiny")


@pytest.mark.parametrize("name", CONFIGS)
def test_overrides_apply_and_misspelled_fields_fail(name):
    config = load_config(f"configs/{name}.py:tiny",
                         ["--config.train.steps=3", "--config.optim.actor.learning_rate=2e-6",
                          "--config.rollout.temperature=0.7", "--config.workdir=/tmp/x"])
    assert config.train.steps == 3
    assert config.optim.actor.learning_rate == 2e-6
    assert config.rollout.temperature == 0.7
    assert config.workdir == "/tmp/x"
    validate(config)
    with pytest.raises((AttributeError, ValueError), match='Did you mean "steps"'):
        load_config(f"configs/{name}.py:tiny", ["--config.train.stpes=3"])
    with pytest.raises(ValueError, match="steps"):
        load_config(f"configs/{name}.py:tiny", ["--config.train.steps=three"])


@pytest.mark.parametrize("name", CONFIGS)
def test_vllm_urls_override_with_repeated_flags(name):
    arg = "tiny,vllm" if "engine" in module(name).AXES else "tiny"
    flags = ["--config.rollout.engine=vllm", "--config.rollout.vllm_urls=http://h1:8000",
             "--config.rollout.vllm_urls=http://h2:8000"]
    config = load_config(f"configs/{name}.py:{arg}", flags)
    assert config.rollout.vllm_urls == ("http://h1:8000", "http://h2:8000")
    if config.model.compact_vocab:  # cpu_demo: vLLM serves HF ids, which compact ids are not
        with pytest.raises(ValueError, match=r"config\.rollout\.engine='vllm'.*compact_vocab"):
            validate(config)
        config = load_config(f"configs/{name}.py:{arg}",
                             [*flags, "--config.model.compact_vocab=false"])
    validate(config)


@pytest.mark.parametrize("name,arg", ALL_VARIANTS, ids=[f"{n}:{a}" for n, a in ALL_VARIANTS])
def test_every_option_is_spelled_out_so_it_can_be_overridden(name, arg):
    # A locked ConfigDict cannot gain keys: an option left to its default in
    # the file could not be set with --config.credit.options.X=... .
    config = load_config(f"configs/{name}.py:{arg}")
    scheme = credit.get_scheme(config.credit.scheme)
    assert set(config.credit.options) == set(scheme.options)
    if config.credit.transform:
        transform = credit.get_transform(config.credit.transform)
        assert set(config.credit.transform_options) == set(transform.options)
    task_type = type(get_task(config.task.name))
    parameters = {p.name for p in inspect.signature(task_type).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert set(config.task.options) == parameters
    get_task(config.task.name, **config.task.options)


def test_credit_option_override_reaches_the_scheme():
    config = load_config("configs/portool.py:tiny", ["--config.credit.options.gamma=0.9"])
    assert config.credit.options.gamma == 0.9
    config = load_config("configs/prs_vspo.py:tiny",
                         ["--config.credit.transform_options.temperature=0.5"])
    assert config.credit.transform_options.temperature == 0.5


@pytest.mark.parametrize("spec,error", [
    ("configs/cm2.py:qwen3_8b,bogus", "unknown token 'bogus'"),
    ("configs/cm2.py:step,turn", "both set axis 'level'"),
    ("configs/carl.py:qwen3_8b", "unknown token 'qwen3_8b'"),
])
def test_bad_args_name_the_grammar(spec, error):
    path, arg = spec.split(":")
    with pytest.raises(ValueError, match=error) as raised:
        module(pathlib.Path(path).stem).get_config(arg)
    assert "model:" in str(raised.value)
    # Through the loader (the CLI's) the message arrives as a ValueError.
    with pytest.raises(ValueError, match=error):
        load_config(spec)


def test_arg_tokens_are_order_free():
    assert load_config("configs/cm2.py:step,qwen3_8b") == load_config(
        "configs/cm2.py:qwen3_8b,step,jax")


# -- docstrings -----------------------------------------------------------------------------


def docstring_commands(name: str) -> list[list[str]]:
    """The `agentrl train ...` commands of the module docstring, continuations joined."""
    text = ast.get_docstring(ast.parse((ROOT / "configs" / f"{name}.py").read_text()))
    text = text.replace("\\\n", " ")
    return [shlex.split(line[line.index("agentrl train"):]) for line in text.splitlines()
            if "agentrl train" in line]


@pytest.mark.parametrize("name", CONFIGS)
def test_docstring_launch_commands_load(name):
    commands = docstring_commands(name)
    assert commands, f"configs/{name}.py documents no `agentrl train` command"
    for command in commands:
        spec = command[command.index("--config") + 1]
        assert spec.split(":")[0] == f"configs/{name}.py"
        overrides = [a for a in command if a.startswith("--config.")]
        assert any(a.startswith("--config.workdir=") for a in overrides)
        validate(load_config(spec, overrides))


# -- the papers' numbers (SPEC) -------------------------------------------------------------


def test_grpo_and_dr_grpo():
    grpo = load_config("configs/grpo.py:qwen2_5_7b")
    assert grpo.credit.options.scale == "std"
    assert grpo.rollout.group_size == 21  # MT-GRPO seed App. D.3
    assert grpo.optim.actor.learning_rate == 1e-6
    assert grpo.loss.kl_coef == 0.0
    assert grpo.task.name == "multihop_search"
    assert load_config("configs/grpo.py:tiny").task.name == "arithmetic"
    dr = load_config("configs/dr_grpo.py:qwen2_5_7b")
    assert dr.credit.scheme == "dr_grpo" and dr.credit.options.scale == "none"  # SPEC §1
    assert dr.loss.aggregation == "seq_mean_token_sum_norm"
    assert dr.loss.norm_length == dr.rollout.max_steps * dr.rollout.max_step_tokens
    for field in ("rollout", "optim", "train", "task", "model"):
        assert dr[field] == grpo[field]


def test_mt_grpo():  # SPEC §3, App. D.3
    config = load_config("configs/mt_grpo.py:qwen2_5_7b")
    assert config.credit.scheme == "mt_grpo"
    assert config.rollout.group_size == 21
    assert config.rollout.steps_are_turns
    assert config.rollout.max_steps == 2
    assert config.loss.kl_coef == 0.0
    assert config.optim.actor.learning_rate == 1e-6
    assert config.train.ppo_epochs == 2
    assert config.task.name == "multihop_search"


def test_mt_ppo():  # SPEC §4: γ = λ = 1; App. B.2
    for arg, scheme in [("qwen2_5_7b", "mt_ppo"), ("qwen2_5_7b,ppo", "gae")]:
        config = load_config(f"configs/mt_ppo.py:{arg}")
        assert config.credit.scheme == scheme
        assert config.credit.options.gamma == 1.0 and config.credit.options.lambda_ == 1.0
        assert config.value.mode == "separate"
        assert config.optim.actor.learning_rate == 1e-6
        assert config.optim.critic.learning_rate == 1e-5
        assert config.loss.kl_coef == 0.001 and config.loss.clip_low == 0.2
        assert config.rollout.prompts_per_step == 512
        assert config.train.num_minibatches == 2  # mini-batch 256
        assert config.rollout.max_steps == 4
        assert config.task.options.top_k == 3
        assert config.task.name == "multihop_search"


@pytest.mark.parametrize("level", ["trajectory", "turn", "step"])
def test_cm2(level):  # SPEC §5.4: scale none, G = 48, trajectory level by default
    config = load_config(f"configs/cm2.py:qwen3_8b,{level}")
    assert config.credit.scheme == "checklist"
    assert config.credit.options.level == level
    assert config.credit.options.scale == "none"
    assert config.rollout.group_size == 48
    assert config.rollout.loop == "dialogue" and config.task.name == "multiturn_tools"
    assert config.optim.actor.learning_rate == 3e-6
    assert config.loss.kl_coef == 0.001
    assert config.model.name == "qwen3_8b" and config.model.hf_path.endswith("Qwen3-8B-Base")
    assert load_config("configs/cm2.py:qwen3_8b").credit.options.level == "trajectory"
    assert load_config(f"configs/cm2.py:tiny,{level}").credit.options.scale == "none"


@pytest.mark.parametrize("model", ["qwen2_5_7b", "qwen3_1_7b"])
def test_portool(model):  # SPEC §6.3: n = 8, γ = 0.95, no KL, LoRA r16 α8
    config = load_config(f"configs/portool.py:{model}")
    assert config.credit.scheme == "tree" and config.rollout.loop == "tree"
    assert config.rollout.tree_n == 8
    assert config.credit.options.gamma == 0.95
    assert config.credit.options.fmt_bound == 0.25
    assert config.credit.options.rule == "portool"
    assert config.credit.options.weighting == "theorem"
    assert config.loss.kl_coef == 0.0
    assert config.model.lora.rank == 16 and config.model.lora.alpha == 8.0
    assert config.optim.actor.learning_rate == 1e-6
    assert config.rollout.final_answer_tool == "response_gen"
    assert config.task.options.final_tool


def test_portool_ablations():
    for rule, weighting in itertools.product(["portool", "max", "avg", "mix2"],
                                             ["theorem", "traj_only", "fork_only", "no_scale"]):
        options = load_config(f"configs/portool.py:qwen3_1_7b,{weighting},{rule}").credit.options
        assert (options.rule, options.weighting) == (rule, weighting)


@pytest.mark.parametrize("model", ["tiny", "qwen2_5_3b", "qwen2_5_7b"])
def test_prs_vspo(model):  # SPEC §8: T = 0.1, α = 2, 5 rollouts
    config = load_config(f"configs/prs_vspo.py:{model}")
    assert config.credit.scheme == "grpo" and config.credit.transform == "vspo"
    assert config.credit.transform_options.temperature == 0.1
    assert config.credit.transform_options.alpha == 2.0
    assert config.rollout.group_size == 5
    assert config.loss.kl_coef == 0.001 and config.loss.clip_low == 0.2
    if model != "tiny":
        assert config.optim.actor.learning_rate == 1e-7
        assert config.model.lora.rank == 0  # full-parameter training
    baseline = load_config(f"configs/prs_vspo.py:{model},grpo")
    assert baseline.credit.transform == ""
    assert baseline.rollout == config.rollout


@pytest.mark.parametrize("model", ["qwen2_5_3b", "qwen2_5_7b"])
def test_carl(model):  # SPEC §9.3-9.4
    config = load_config(f"configs/carl.py:{model}")
    assert config.credit.scheme == "segment" and config.rollout.loop == "segment"
    assert config.credit.options.gamma == 1.0 and config.credit.options.lambda_ == 0.0
    assert (config.value.mode, config.value.head) == ("shared", "carl")
    assert config.optim.actor.learning_rate == 1e-6
    assert config.optim.critic.learning_rate == 5e-6
    assert config.optim.critic_backbone.learning_rate == 5e-7
    assert config.optim.critic.weight_decay == 0.0
    assert config.optim.critic_backbone.weight_decay == 0.01
    assert config.loss.value_coef == 0.5  # c_v
    assert config.loss.entropy_coef == 0.001
    assert config.loss.kl_coef == 0.001 and config.loss.kl_kind == "k3"
    assert config.loss.clip_low == config.loss.clip_high == 0.2
    assert config.loss.aggregation == "segment_mean_sum"
    assert config.rollout.group_size == 5
    assert config.rollout.prompts_per_step == 256
    assert config.train.ppo_epochs == 4
    assert config.rollout.prompts_per_step * config.rollout.group_size \
        // config.train.num_minibatches == 64  # mini-batch 64
    assert 2 * config.rollout.max_steps + 1 == 15  # segments: K tool calls → 2K + 1
    assert (config.warmup.auc, config.warmup.sign_accuracy,
            config.warmup.explained_variance) == (0.70, 0.60, 0.45)
    assert config.warmup.steps > 0 and config.warmup.require_gate
    assert load_config(f"configs/carl.py:{model},cold").warmup.steps == 0


def test_cpu_demo():
    config = load_config("configs/cpu_demo.py")
    assert (config.model.name, config.tokenizer, config.task.name) == (
        "tiny", "qwen2.5", "arithmetic")
    assert config.sft.steps > 0 and config.train.steps > 0
    assert config.credit.scheme == "grpo" and config.rollout.engine == "jax"
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (1, 1, 1)
    demo = module("cpu_demo").DEMO
    assert config.train.steps == demo["rl_steps"] and config.sft.steps == demo["sft_steps"]


# -- launch scripts -------------------------------------------------------------------------


def run_script(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The script in DRY_RUN mode, from an empty directory that must stay empty."""
    environment = {**os.environ, "DRY_RUN": "1", "AGENTRL": "agentrl", **(env or {})}
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(["bash", str(ROOT / "launch" / script), *args], cwd=cwd,
                                env=environment, capture_output=True, text=True, timeout=60)
        assert not list(pathlib.Path(cwd).iterdir()), f"DRY_RUN {script} wrote files"
    return result


@pytest.mark.parametrize("script", LAUNCH)
def test_launch_script_parses(script):
    path = ROOT / "launch" / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(path, os.X_OK)


@pytest.mark.parametrize("script", LAUNCH)
def test_launch_script_usage(script):
    result = run_script(script)
    assert result.returncode == 2
    assert "launch/" in result.stdout


def test_local_dry_run():
    result = run_script("local.sh", "configs/carl.py:qwen2_5_7b,cold", "--config.train.steps=3")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert command[:4] == ["agentrl", "train", "--config", "configs/carl.py:qwen2_5_7b,cold"]
    assert "--config.workdir=/tmp/agentrl/carl-qwen2_5_7b-cold" in command
    assert command[-1] == "--config.train.steps=3"
    load_config(command[3], command[4:])


def test_slurm_dry_run():
    env = {"SLURM_JOB_ID": "12345", "SLURM_JOB_NODELIST": "gpu[007-010],cpu1",
           "GPUS_PER_NODE": "4", "PATH": "/usr/bin:/bin"}  # no scontrol: the bash parser
    result = run_script("slurm.sbatch", "configs/carl.py:qwen2_5_7b",
                        "--config.workdir=/shared/run1", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # JAX's own SLURM port: SLURM_JOB_ID % 4096 + 61440.
    assert lines[0] == f"JAX_COORDINATOR_ADDRESS=gpu007:{12345 % 4096 + 61440}"
    assert lines[1] == "JAX_LOCAL_DEVICE_IDS=0,1,2,3"
    command = shlex.split(lines[2])
    assert command[0] == "srun" and "--ntasks-per-node=1" in command
    assert command[command.index("train") - 1] == "agentrl"
    missing_workdir = run_script("slurm.sbatch", "configs/carl.py:qwen2_5_7b", env=env)
    assert missing_workdir.returncode == 2 and "--config.workdir" in missing_workdir.stderr


def test_vllm_servers_dry_run_has_the_flags_vllm_engine_needs():
    result = run_script("vllm_servers.sh", "/models/Qwen2.5-7B-Instruct", "2",
                        env={"TP": "2", "GPU_OFFSET": "4", "LORA_RANK": "16"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    servers = [shlex.split(line) for line in lines if "vllm serve" in line]
    assert len(servers) == 2
    for index, command in enumerate(servers):
        assert f"CUDA_VISIBLE_DEVICES={4 + 2 * index},{5 + 2 * index}" in command
        assert "VLLM_SERVER_DEV_MODE=1" in command
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in command
        assert "VLLM_USE_FLASHINFER_SAMPLER=0" in command
        text = " ".join(command)
        for flag in ["--logprobs-mode processed_logprobs", "--enable-prefix-caching",
                     "--generation-config vllm", "--served-model-name policy", "--enable-lora",
                     "--max-lora-rank 16", "--max-loras 2", f"--port {8000 + index}",
                     "--tensor-parallel-size 2"]:
            assert flag in text
    overrides = shlex.split(lines[-1].split(":", 1)[1])
    assert "--config.rollout.vllm_model=policy" in overrides
    config = load_config("configs/portool.py:qwen2_5_7b", overrides)
    assert config.rollout.engine == "vllm" and len(config.rollout.vllm_urls) == 2
    validate(config)
    no_lora = run_script("vllm_servers.sh", "/models/Qwen3-8B")
    assert "--enable-lora" not in no_lora.stdout


def test_vllm_servers_agentrl_stand_in_dry_run():
    result = run_script("vllm_servers.sh", "tiny", "1", env={"SERVER": "agentrl"})
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[0])
    assert command[:2] == ["agentrl", "serve"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--config.rollout.vllm_urls=http://127.0.0.1:8000" in result.stdout


def test_rollout_workers_dry_run():
    result = run_script("rollout_workers.sh", "2", "configs/grpo.py:tiny,vllm",
                        "--config.workdir=/shared/run1", env={"WORKER_OFFSET": "4",
                                                              "TOTAL_WORKERS": "8"})
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert [c[c.index("--worker-id") + 1] for c in commands] == ["4", "5"]
    for command in commands:
        assert command[:4] == ["agentrl", "rollout-worker", "--config", "configs/grpo.py:tiny,vllm"]
        overrides = [a for a in command if a.startswith("--config.")]
        assert "--config.async_rollout.workers=8" in overrides
        config = load_config(command[3], overrides)
        assert config.async_rollout.enabled and config.workdir == "/shared/run1"
    missing_workdir = run_script("rollout_workers.sh", "2", "configs/grpo.py:tiny")
    assert missing_workdir.returncode == 2


def test_readme_names_every_script():
    readme = (ROOT / "launch" / "README.md").read_text()
    for script in LAUNCH:
        assert f"launch/{script}" in readme
    assert re.search(r"JAX_COORDINATOR_ADDRESS", readme)
