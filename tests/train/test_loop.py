"""The training job end to end on tiny models: every scheme, resume, async, errors."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from agentrl.train.config import validate
from agentrl.train.loop import Trainer
from tests.train.tiny_config import tiny_base, tiny_from

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCHEME_CONFIGS = [
    ("configs/grpo.py:tiny", "grpo"),
    ("configs/dr_grpo.py:tiny", "dr_grpo"),
    ("configs/mt_grpo.py:tiny", "mt_grpo"),
    ("configs/mt_ppo.py:tiny", "mt_ppo"),
    ("configs/mt_ppo.py:tiny,ppo", "gae"),
    ("configs/cm2.py:tiny,step", "checklist"),
    ("configs/portool.py:tiny", "tree"),
    ("configs/prs_vspo.py:tiny", "grpo"),
    ("configs/carl.py:tiny,cold", "segment"),
]


@pytest.mark.parametrize("spec,scheme", SCHEME_CONFIGS, ids=[s for s, _ in SCHEME_CONFIGS])
def test_every_scheme_runs_a_full_step(spec, scheme, tmp_path):
    config = tiny_from(spec, tmp_path)
    validate(config)
    assert config.credit.scheme == scheme
    trainer = Trainer(config, log=lambda *a: None)
    trainer.sft()
    before = np.asarray(trainer.state.params["policy"]["embed_tokens"]).copy()
    metrics = trainer.rl_step()
    assert metrics["finite"] == 1.0
    assert np.isfinite(metrics["loss"])
    assert int(trainer.state.step) == 1
    assert trainer.steps_done == 1
    after = np.asarray(trainer.state.params["policy"]["embed_tokens"])
    # The update moves the policy unless every advantage was zero.
    if metrics["credit/adv_abs_mean"] > 0:
        assert np.abs(after - before).max() > 0
    assert {"reward", "success", "time/rollout", "time/update", "clip_fraction", "entropy",
            "zero_variance_groups", "tokens_per_episode", "tool_calls_per_episode"} <= set(metrics)
    assert metrics["skipped_updates"] == 0.0
    if config.value.mode != "none":
        assert "critic_loss" in metrics


def test_bad_configs_fail_before_compute(tmp_path):
    config = tiny_base(tmp_path)
    config.credit.scheme = "gae"
    with pytest.raises(ValueError, match=r"value\.mode"):
        Trainer(config)
    config = tiny_base(tmp_path)
    config.data.train_prompts = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"data\.train_prompts"):
        Trainer(config)
    config = tiny_base(tmp_path)
    config.rollout.loop = "dialogue"  # the arithmetic task has no dialogues
    with pytest.raises(ValueError, match=r"needs a dialogue task"):
        validate(config)
    config = tiny_base(tmp_path)
    config.train.export_hf = True  # compact ids match no HF tokenizer
    with pytest.raises(ValueError, match=r"config\.train\.export_hf=True .*compact_vocab"):
        validate(config)
    config = tiny_base(tmp_path)
    config.credit.scheme = "tree"  # needs the tree rollout
    with pytest.raises(ValueError, match=r"rollout\.loop"):
        validate(config)


def _train_command(workdir, steps):
    return [sys.executable, "-m", "agentrl.cli", "train", "--config",
            str(ROOT / "tests" / "train" / "resume_config.py"),
            f"--config.workdir={workdir}", f"--config.train.steps={steps}"]


def _metrics(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "wall_time"}
            for r in records]


def test_sigkill_and_resume_reproduces_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    straight = tmp_path / "straight"
    subprocess.run(_train_command(straight, 4), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=900)
    killed = tmp_path / "killed"
    process = subprocess.Popen(_train_command(killed, 4), env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = killed / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once step 2 is checkpointed
        if (checkpoints / "2").exists() and process.poll() is None:
            time.sleep(0.5)
            process.send_signal(signal.SIGKILL)
            break
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    subprocess.run(_train_command(killed, 4), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=900)
    expected, resumed = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == [0, 1, 2, 3, 4]
    for a, b in zip(expected, resumed, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def _worker_command(workdir, max_shards):
    return [sys.executable, "-m", "agentrl.cli", "rollout-worker", "--config",
            str(ROOT / "tests" / "train" / "resume_config.py") + ":async",
            f"--config.workdir={workdir}", "--worker-id", "0", "--max-shards", str(max_shards)]


def test_async_worker_killed_and_restarted_loses_and_duplicates_no_shard(tmp_path):
    """A SIGKILLed rollout worker resumes after its last shard; the trainer reads each once."""
    from agentrl.data.prompts import PromptIterator
    from agentrl.rollout.shards import list_shards, read_shard
    from agentrl.train.config import load_config
    from agentrl.train.worker import publish_policy, shard_dir

    config = load_config(str(ROOT / "tests" / "train" / "resume_config.py") + ":async",
                         [f"--config.workdir={tmp_path}"])
    trainer = Trainer(config, log=lambda *a: None)
    publish_policy(trainer)  # the policy version the worker waits for
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = shard_dir(config)
    process = subprocess.Popen(_worker_command(tmp_path, 50), env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        if len(list_shards(out)) >= 2:  # kill mid-run, at an arbitrary point after shard 2
            time.sleep(0.7)
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.1)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the worker ended before it could be killed"
    written_before = len(list_shards(out))
    subprocess.run(_worker_command(tmp_path, 2), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=600)
    shards = list_shards(out)
    assert [p.name.split(".")[0] for p in shards] == [f"worker0-{i:06d}"
                                                      for i in range(written_before + 2)]
    # The prompts, shard after shard, follow the worker's prompt order with no gap or repeat.
    prompts = PromptIterator(trainer.train_instances, seed=config.seed, shard_index=0,
                             shard_count=1)
    group = config.rollout.group_size
    for path in shards:
        header, trajectories = read_shard(path)
        expected = [i.prompt.prompt_id for i in prompts.next_batch(config.rollout.prompts_per_step)]
        got = [t.prompt_id for t in trajectories]
        assert got == [p for p in expected for _ in range(group)], path.name
        assert header["policy_version"] == 0
    # The trainer consumes every shard once, in order, and trains on it.
    consumed = []
    for _ in range(len(shards)):
        metrics = trainer.rl_step()
        assert np.isfinite(metrics["loss"])
    consumed = trainer.shard_batcher.get_state()["reader"]["consumed"]
    assert consumed == [p.name for p in shards]
