"""Metrics JSONL (flush, truncation on resume), TensorBoard, W&B, progress bar, `agentrl plot`."""

import io
import json
import struct
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from agentrl import cli
from agentrl.train import plot
from agentrl.train.metrics import (
    MetricsWriter,
    ProgressBar,
    progress_text,
    read_metrics,
    truncate_metrics,
)


def _lines(workdir):
    return (workdir / "metrics.jsonl").read_text().splitlines()


def _steps(workdir):
    return [json.loads(line)["step"] for line in _lines(workdir)]


def test_writes_one_flushed_json_object_per_step(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, active=True)
    record = writer.write(1, {"reward": np.float32(0.5), "kl": jnp.asarray(0.25),
                              "finite": True, "tool_calls": 3, "grad_norm": float("nan"),
                              "phase": "rl", "loss": jnp.asarray(1.5, jnp.bfloat16)},
                          wall_time=123.0)
    assert record == {"step": 1, "wall_time": 123.0, "reward": 0.5, "kl": 0.25, "finite": 1,
                      "tool_calls": 3, "grad_norm": None, "phase": "rl", "loss": 1.5}
    # On disk before close: a kill now loses nothing already written.
    assert [json.loads(line) for line in _lines(tmp_path)] == [record]
    writer.write(2, {"reward": 1.0})
    assert _steps(tmp_path) == [1, 2]
    with pytest.raises(TypeError, match=r"metric 'logits' has shape \(3,\)"):
        writer.write(3, {"logits": np.zeros(3)})
    with pytest.raises(TypeError, match=r"metric 'ids' has shape \(\) and dtype object"):
        writer.write(3, {"ids": None})
    with pytest.raises(ValueError, match=r"\['step'\] are reserved"):
        writer.write(3, {"step": 1})
    writer.close()
    assert _steps(tmp_path) == [1, 2]


def test_resume_drops_later_steps_and_the_partial_line(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, active=True) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": 1.0 / step}, wall_time=0.0)
    uninterrupted = _lines(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]

    with MetricsWriter(tmp_path, tensorboard=False, active=True, resume_step=3) as writer:
        assert _steps(tmp_path) == [1, 2, 3]
        for step in (4, 5):
            writer.write(step, {"loss": 1.0 / step}, wall_time=0.0)
    assert _lines(tmp_path) == uninterrupted

    # resume_step=None keeps every complete line and only drops a partial one.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')
    MetricsWriter(tmp_path, tensorboard=False, active=True).close()
    assert _lines(tmp_path) == uninterrupted
    assert truncate_metrics(tmp_path / "metrics.jsonl", 0) == 5
    assert _lines(tmp_path) == []


def test_malformed_line_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2: not valid JSON"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"line 2: not a metrics record"):
        MetricsWriter(tmp_path, tensorboard=False, active=True, resume_step=1)


def test_inactive_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(tmp_path / "run", active=False)
    assert writer.write(1, {"reward": 1.0})["reward"] == 1.0
    writer.close()
    assert not (tmp_path / "run").exists()


def _events(logdir):
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
            offset += 12 + length + 4
    return events


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    with MetricsWriter(tmp_path, active=True) as writer:
        for step in range(1, 4):
            writer.write(step, {"reward": step / 10, "phase": "rl"})
    scalars = [(e.step, v.tag, round(v.simple_value, 6)) for e in _events(tmp_path / "tensorboard")
               for v in e.summary.value]
    assert scalars == [(1, "reward", 0.1), (2, "reward", 0.2), (3, "reward", 0.3)]
    with MetricsWriter(tmp_path, active=True, resume_step=2) as writer:
        writer.write(3, {"reward": 0.9})
    starts = [e.step for e in _events(tmp_path / "tensorboard")
              if e.WhichOneof("what") == "session_log" and e.session_log.status == 1]
    assert starts == [3]  # TensorBoard discards older events from step 3 on


def test_tensorboard_missing_warns_and_keeps_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.warns(UserWarning, match="tensorboardX is not installed"):
        writer = MetricsWriter(tmp_path, active=True)
    writer.write(1, {"reward": 1.0})
    writer.close()
    assert _steps(tmp_path) == [1] and not (tmp_path / "tensorboard").exists()


def test_wandb_is_optional_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsWriter(tmp_path, tensorboard=False, wandb=True, active=True)

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)) or Run(),
        util=types.SimpleNamespace(generate_id=lambda: "run123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsWriter(tmp_path, tensorboard=False, wandb=True, active=True,
                       wandb_options={"project": "p"}) as writer:
        writer.write(1, {"reward": 0.5, "phase": "rl"})
    MetricsWriter(tmp_path, tensorboard=False, wandb=True, active=True, resume_step=1).close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0] == {"project": "p", "id": "run123", "resume": "allow", "dir": str(tmp_path)}
    assert inits[1]["id"] == "run123"  # read back from wandb_run_id.txt
    assert ("log", {"reward": 0.5}, 1) in calls and calls.count(("finish",)) == 2


def test_progress_bar_shows_the_key_numbers():
    metrics = {"reward": 0.5, "success": 0.25, "kl": 0.0012, "step_time": 2.5, "other": 1}
    assert progress_text(metrics) == "reward 0.500 success 0.250 kl 1.20e-03 step_time 2.50s"
    assert progress_text({"train/reward": 1.0}) == "reward 1.000"
    with_tools = {"reward": 1.0, "tool_calls_per_episode": 0.5}
    assert progress_text(with_tools) == "reward 1.000 tools 0.500"
    stream = io.StringIO()
    bar = ProgressBar(10, initial=2, stream=stream, use_tqdm=False, min_interval_s=0)
    bar.update(3, metrics)
    bar.update(10, {"reward": 0.75})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("train step 3/10 (30%) reward 0.500 success 0.250")
    assert lines[1].startswith("train step 10/10 (100%) reward 0.750 step_time ")  # measured
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, use_tqdm=True)
    bar.update(4, metrics)
    bar.close()
    assert "4/10" in stream.getvalue() and "reward 0.500" in stream.getvalue()


# ---------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------


def _run(workdir, steps=30):
    with MetricsWriter(workdir, tensorboard=False, active=True) as writer:
        for step in range(1, steps + 1):
            metrics = {"reward": np.tanh(step / 10), "success": step / steps,
                       "tool_calls_per_episode": 1 + (step % 3), "kl": 1e-3 * step,
                       "entropy": 2 - step / 30,
                       "policy_loss": 1 / step, "critic_loss": 0.5 / step, "step_time": 1.5,
                       "time/rollout": 1.0, "time/update": 0.5}
            if step % 10 == 0:
                metrics["eval/success"] = step / steps / 2
            writer.write(step, metrics)


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024, path
    with Image.open(path) as image:
        image.load()
        assert image.width > 100 and image.height > 100


def test_plot_writes_decodable_pngs(tmp_path):
    _run(tmp_path)
    paths = plot.plot_metrics(tmp_path)
    assert sorted(p.name for p in paths) == sorted(
        ["reward.png", "success.png", "tool_calls.png", "kl.png", "entropy.png", "losses.png",
         "step_time.png", "curves.png"])
    assert all(p.parent == tmp_path / "plots" for p in paths)
    for path in paths:
        _assert_png(path)


def test_plot_panels_follow_the_keys_present(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, active=True) as writer:
        for step in range(3):
            writer.write(step, {"train/reward": step, "sft_loss": 1.0, "grad_norm": 2.0})
    names = sorted(p.name for p in plot.plot_metrics(tmp_path, tmp_path / "out"))
    assert names == ["curves.png", "losses.png", "reward.png"]


def test_plot_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot.plot_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics records"):
        plot.plot_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0, "grad_norm": 1}\n')
    with pytest.raises(ValueError, match=r"no plotted keys \(found \['grad_norm'\]\)"):
        plot.plot_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"smooth=1 must be in \[0, 1\)"):
        plot.plot_metrics(tmp_path, smooth=1)


def test_smoothing_is_a_debiased_moving_average():
    assert plot.smoothed([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert plot.smoothed([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    assert plot.smoothed([3.0, 5.0], 0.0) == [3.0, 5.0]


def test_plot_command(tmp_path, capsys):
    _run(tmp_path / "run", steps=5)
    assert cli.main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and (tmp_path / "png" / "curves.png").is_file()
    _assert_png(tmp_path / "png" / "reward.png")
    assert cli.main(["plot", str(tmp_path / "missing")]) == 1
    assert "agentrl plot: no metrics file" in capsys.readouterr().err
