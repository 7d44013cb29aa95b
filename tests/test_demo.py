"""The main job: the CPU demo run learns (slow; `.ci/run` runs it after the suite).

    pytest -m slow tests/test_demo.py

Runs the README's demo command (`agentrl train --config configs/cpu_demo.py`,
seed 0, measured with two more seeds in docs/benchmarks.md) unchanged, about
13 minutes on 2 cores, and checks what a user would: checkpoints, metrics,
curves, and held-out success after RL above the SFT starting point. A
shortened run does not show it reliably: seed 0's greedy success stays at
its SFT level for 20 RL steps and jumps between steps 20 and 30.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 13 minutes; the suite's default limit is 600 s
def test_cpu_demo_improves_held_out_success(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "agentrl.cli", "train", "--config",
               str(ROOT / "configs" / "cpu_demo.py"), f"--config.workdir={tmp_path}"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/success"] for r in records if r.get("eval/success") is not None}
    assert sorted(evals) == [0, 10, 20, 30, 40]
    print("held-out success:", " | ".join(f"step {k} {v:.2f}" for k, v in sorted(evals.items())))
    assert evals[40] >= evals[0] + 0.05, evals
    assert [r["step"] for r in records] == list(range(41))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["20", "30", "40"]
    assert (tmp_path / "plots" / "reward.png").is_file()
    assert (tmp_path / "plots" / "success.png").is_file()
