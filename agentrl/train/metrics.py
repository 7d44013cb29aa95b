"""Run metrics: `metrics.jsonl` (the record), TensorBoard events, optional W&B, a progress bar.

    with MetricsWriter(workdir, resume_step=restored_step or 0) as writer:
        bar = ProgressBar(total_steps, initial=restored_step or 0)
        for step in ...:
            metrics = {...}                  # scalars: python, numpy or 0-d jax values
            writer.write(step, metrics)      # before checkpointer.save(step, ...)
            bar.update(step, metrics)
        bar.close()

`workdir/metrics.jsonl` holds one JSON object per `write` call:
`{"step": int, "wall_time": unix seconds, <key>: number | string | null}`
(null: a non-finite value; bools are written as 0/1). Each line goes out in
one `write` and is flushed, so a SIGKILL loses at most the line being written.
Opening the writer drops a partial last line; with `resume_step=s` it also
drops every line with `step > s` (rewriting the file atomically), so a run
resumed from the checkpoint of step `s` ends with the same lines, timing keys
aside, as an uninterrupted run. Write step `s`'s metrics before saving its
checkpoint so that line is never missing.

TensorBoard: scalars go to `workdir/tensorboard/` through `tensorboardX` when
it is installed (a warning says so when it is not); a resumed writer sets
`purge_step = s + 1`, which makes TensorBoard discard the older events of the
steps that are written again. W&B (`wandb=True`) needs the `wandb` package.
"""

import contextlib
import json
import math
import os
import pathlib
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "wall_time")
WANDB_RUN_ID_FILE = "wandb_run_id.txt"

# Display name → metric keys, first present wins (the progress bar and `agentrl plot`).
PROGRESS_KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "train/reward", "rollout/reward"),
    "success": ("success", "train/success", "rollout/success"),
    "kl": ("kl", "train/kl"),
    "tools": ("tool_calls_per_episode", "tool_calls"),
    "step_time": ("step_time", "time/step"),
}


def _scalar(key: str, value: Any) -> float | int | str | None:
    """A metric value as a JSON scalar (None for non-finite floats)."""
    if isinstance(value, str):
        return value
    array = np.asarray(value)
    if array.size == 1 and array.dtype.kind == "V":
        with contextlib.suppress(TypeError, ValueError):  # bfloat16 and other ml_dtypes
            array = array.astype(np.float32)
    if array.size != 1 or array.dtype.kind not in "biuf":
        raise TypeError(
            f"metric {key!r} has shape {array.shape} and dtype {array.dtype}: not a scalar "
            "number; log a mean or one value per key (strings are allowed too).")
    scalar = array.reshape(()).item()
    if isinstance(scalar, bool):
        return int(scalar)
    if isinstance(scalar, float) and not math.isfinite(scalar):
        return None
    return scalar


def _split_lines(text: str) -> tuple[list[str], str]:
    """Complete lines (without newlines) and the partial tail (text after the last newline)."""
    head, _, tail = text.rpartition("\n")
    return (head.split("\n") if head else []), tail


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics file (or a workdir holding `metrics.jsonl`).

    A partial last line (a write cut off by a kill) is ignored; a malformed
    complete line is an error naming the file and the line.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}; a run writes it in its workdir "
                                f"({METRICS_FILE}).")
    lines, _ = _split_lines(path.read_text(encoding="utf-8"))
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not valid JSON ({error.msg}); the file "
                             "holds one JSON object per line.") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path} line {number}: expected an object with an integer 'step', "
                             f"got {line[:100]!r}.")
        records.append(record)
    return records


def truncate_metrics(path: str | os.PathLike, step: int | None) -> int:
    """Drops a partial last line and (if `step` is given) lines with `step > step`.

    Rewrites the file atomically (temporary file, fsync, rename) and only when
    something is dropped. Returns the number of lines dropped.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return 0
    lines, tail = _split_lines(path.read_text(encoding="utf-8"))
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if step is not None:
            try:
                line_step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path} line {number}: not a metrics record ({line[:100]!r}); "
                                 "fix or remove the line, then resume.") from None
            if line_step > step:
                continue
        kept.append(line)
    dropped = len(lines) - len(kept) + (1 if tail else 0)
    if dropped:
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                f.write("".join(f"{line}\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            pathlib.Path(temp).unlink(missing_ok=True)
            raise
    return dropped


class MetricsWriter:
    """Writes each step's scalars to `metrics.jsonl`, TensorBoard and (optionally) W&B.

    Args:
      workdir: the run's directory (created if missing).
      tensorboard: also write TensorBoard events (needs `tensorboardX`; when
        it is missing a warning says so and only the JSONL is written).
      wandb: also log to Weights & Biases (needs `wandb`; an ImportError
        otherwise). The run id is kept in `workdir/wandb_run_id.txt` so a
        resumed run continues the same W&B run.
      wandb_options: extra `wandb.init` keyword arguments (project, config, ...).
      resume_step: the step the run resumes from (the restored checkpoint's,
        0 for a fresh start): lines with a larger step are dropped. None: keep
        every complete line and append.
      active: write anything at all (default: only JAX process 0).
      fsync: fsync after each line (survives power loss, not just a kill).
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True,
                 wandb: bool = False, wandb_options: Mapping[str, Any] | None = None,
                 resume_step: int | None = None, active: bool | None = None,
                 fsync: bool = False):
        if active is None:
            import jax

            active = jax.process_index() == 0
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.active = active
        self.fsync = fsync
        self._file: TextIO | None = None
        self._tensorboard = None
        self._wandb = None
        if not active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            self._tensorboard = _tensorboard_writer(self.workdir / TENSORBOARD_DIR, resume_step)
        if wandb:
            self._wandb = _wandb_run(self.workdir, dict(wandb_options or {}))

    def write(self, step: int, metrics: Mapping[str, Any], *,
              wall_time: float | None = None) -> dict[str, Any]:
        """Writes one record; returns it (as written to the JSONL)."""
        clash = [key for key in RESERVED_KEYS if key in metrics]
        if clash:
            raise ValueError(f"MetricsWriter.write: metric keys {clash} are reserved (the writer "
                             "sets them); rename those metrics.")
        wall_time = time.time() if wall_time is None else float(wall_time)
        record: dict[str, Any] = {"step": int(step), "wall_time": wall_time}
        record.update({str(key): _scalar(str(key), value) for key, value in metrics.items()})
        if not self.active:
            return record
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed.")
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        numbers = {k: v for k, v in record.items()
                   if k not in RESERVED_KEYS and isinstance(v, int | float)}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, global_step=int(step),
                                             walltime=wall_time)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=int(step))
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensorboard_writer(logdir: pathlib.Path, resume_step: int | None):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        warnings.warn(
            "MetricsWriter: TensorBoard events are off because tensorboardX is not installed "
            "(`pip install tensorboardX`); metrics.jsonl is written as usual.", stacklevel=3)
        return None
    purge_step = None if resume_step is None else resume_step + 1
    return SummaryWriter(logdir=str(logdir), purge_step=purge_step, flush_secs=10)


def _wandb_run(workdir: pathlib.Path, options: dict[str, Any]):
    try:
        import wandb
    except ImportError:
        raise ImportError("MetricsWriter(wandb=True) needs the 'wandb' package: "
                          "`pip install wandb`, or pass wandb=False.") from None
    id_file = workdir / WANDB_RUN_ID_FILE
    if "id" not in options:
        if id_file.is_file():
            options["id"] = id_file.read_text().strip()
        else:
            options["id"] = wandb.util.generate_id()
            id_file.write_text(options["id"] + "\n")
    options.setdefault("resume", "allow")
    options.setdefault("dir", str(workdir))
    return wandb.init(**options)


# ---------------------------------------------------------------------------
# Progress bar.
# ---------------------------------------------------------------------------


def _format_value(name: str, value: float) -> str:
    if name.endswith("time"):
        return f"{value:.2f}s"
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4):
        return f"{value:.2e}"
    return f"{value:.3f}"


def progress_text(metrics: Mapping[str, Any],
                  keys: Mapping[str, Sequence[str]] = PROGRESS_KEYS) -> str:
    """`"reward 0.531 success 0.400 kl 1.20e-03 step_time 2.10s"` (the keys present)."""
    parts = []
    for name, candidates in keys.items():
        for key in candidates:
            if key in metrics:
                value = _scalar(key, metrics[key])
                if isinstance(value, int | float):
                    parts.append(f"{name} {_format_value(name, value)}")
                elif value is None:
                    parts.append(f"{name} nan")
                break
    return " ".join(parts)


class ProgressBar:
    """A progress bar of training steps with the key numbers (reward, success, KL, step time).

    Uses `tqdm` when it is importable; otherwise prints a line to `stream`
    at most every `min_interval_s` seconds (and at the last step). The step
    time is the metrics' `step_time` (or `time/step`) when present, else the
    wall time since the previous update divided by the steps advanced.
    """

    def __init__(self, total: int, *, initial: int = 0, description: str = "train",
                 keys: Mapping[str, Sequence[str]] = PROGRESS_KEYS,
                 stream: TextIO | None = None, min_interval_s: float = 5.0,
                 use_tqdm: bool | None = None):
        self.total = total
        self.step = initial
        self.description = description
        self.keys = keys
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._start_step = initial
        self._last_update = self._start
        self._last_print = -math.inf
        self._tqdm = None
        if use_tqdm is None or use_tqdm:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if use_tqdm:
                    raise ImportError("ProgressBar(use_tqdm=True) needs tqdm: `pip install tqdm`."
                                      ) from None
            else:
                self._tqdm = tqdm(total=total, initial=initial, desc=description, unit="step",
                                  file=self.stream, dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> str:
        """Moves to `step` and shows `metrics`' key numbers; returns the text shown."""
        now = time.monotonic()
        advance, self.step = step - self.step, step
        metrics = dict(metrics or {})
        time_keys = self.keys.get("step_time", ())
        if time_keys and advance > 0 and not any(key in metrics for key in time_keys):
            metrics[time_keys[0]] = (now - self._last_update) / advance
        self._last_update = now
        text = progress_text(metrics, self.keys)
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(text, refresh=False)
            self._tqdm.update(advance)
            return text
        if now - self._last_print >= self.min_interval_s or step >= self.total:
            self._last_print = now
            rate = (step - self._start_step) / max(now - self._start, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else math.inf
            eta_text = "?" if math.isinf(eta) else f"{eta:.0f}s"
            line = (f"{self.description} step {step}/{self.total} "
                    f"({100 * step / max(self.total, 1):.0f}%) {text} eta {eta_text}")
            print(line, file=self.stream, flush=True)
        return text

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
