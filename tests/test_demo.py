"""The main job: a shortened CPU demo run learns (slow; `.ci/run` runs it after the suite).

    pytest -m slow tests/test_demo.py

The full demo (`agentrl train --config configs/cpu_demo.py`, 40 RL steps) is
measured in docs/benchmarks.md; this runs its first 20 RL steps with every
other setting unchanged and checks what a user would: checkpoints, metrics,
curves, and held-out success above the SFT starting point.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_shortened_cpu_demo_improves_held_out_success(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "agentrl.cli", "train", "--config",
               str(ROOT / "configs" / "cpu_demo.py"), f"--config.workdir={tmp_path}",
               "--config.train.steps=20", "--config.train.eval_every=10"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/success"] for r in records if r.get("eval/success") is not None}
    assert sorted(evals) == [0, 10, 20]
    print(f"held-out success: after SFT {evals[0]:.2f}, after 10 / 20 RL steps "
          f"{evals[10]:.2f} / {evals[20]:.2f}")
    assert evals[20] >= evals[0] + 0.05, evals
    assert [r["step"] for r in records] == list(range(21))
    assert (tmp_path / "checkpoints" / "20").is_dir()
    assert (tmp_path / "plots" / "reward.png").is_file()
    assert (tmp_path / "plots" / "success.png").is_file()
