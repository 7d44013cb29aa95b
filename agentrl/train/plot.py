"""Learning curves (PNG) from a run's `metrics.jsonl`: `agentrl plot WORKDIR [--out DIR]`.

One PNG per panel that has data, plus `curves.png` with every panel:

    reward.png      reward (train and eval/...)          keys: reward, */reward
    success.png     success rate, eval success           keys: success, */success
    tool_calls.png  tool calls per episode               keys: tool_calls[_per_episode]
    kl.png          KL to the reference / old policy     keys: kl, */kl, approx_kl_old
    entropy.png     policy entropy                       keys: entropy, */entropy
    losses.png      losses                               keys: loss, *_loss, */loss
    step_time.png   step time and its split              keys: step_time, time/*, *_time

A key matches a panel when it equals one of its names or ends with
`/<name>` (so `eval/success` lands beside `success`). Missing points
(keys absent from a record, null values) are skipped. matplotlib is imported
only here, with the headless Agg backend.
"""

import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.train.metrics import RESERVED_KEYS, read_metrics

DEFAULT_OUT = "plots"


def _named(*names: str) -> Callable[[str], bool]:
    return lambda key: any(key == name or key.endswith(f"/{name}") for name in names)


def _is_loss(key: str) -> bool:
    last = key.rsplit("/", 1)[-1]
    return last == "loss" or last.endswith("_loss")


def _is_time(key: str) -> bool:
    return key not in RESERVED_KEYS and (key == "step_time" or key.startswith("time/")
                                         or key.endswith("_time"))


# (file stem, title, y label, key predicate)
PANELS: tuple[tuple[str, str, str, Callable[[str], bool]], ...] = (
    ("reward", "Reward", "mean reward", _named("reward")),
    ("success", "Success rate", "success", _named("success", "success_rate")),
    ("tool_calls", "Tool calls per episode", "calls",
     _named("tool_calls", "tool_calls_per_episode")),
    ("kl", "KL divergence", "KL", lambda key: _named("kl")(key) or key == "approx_kl_old"),
    ("entropy", "Policy entropy", "nats / token", _named("entropy")),
    ("losses", "Losses", "loss", _is_loss),
    ("step_time", "Step time", "seconds", _is_time),
)


def _series(records: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for key, value in record.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if key in RESERVED_KEYS or not numeric or not math.isfinite(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(record["step"])
            values.append(float(value))
    return series


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard-style debiased exponential moving average (`weight` 0: none)."""
    out, average = [], 0.0
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**count))
    return out


def plot_metrics(workdir: str | pathlib.Path, out: str | pathlib.Path | None = None, *,
                 smooth: float = 0.6) -> list[pathlib.Path]:
    """Writes the learning-curve PNGs of a run; returns their paths.

    Args:
      workdir: the run directory (holding `metrics.jsonl`) or the file itself.
      out: where to write the PNGs (default `workdir/plots`).
      smooth: EMA weight in [0, 1) for series of 20 points or more: the raw
        curve is drawn faint, the smoothed one over it (0: raw only).

    Raises:
      FileNotFoundError: no metrics file.
      ValueError: the file holds no records, or none of the plotted keys.
    """
    if not 0 <= smooth < 1:
        raise ValueError(f"plot_metrics: smooth={smooth} must be in [0, 1).")
    workdir = pathlib.Path(workdir)
    metrics_path = workdir if workdir.is_file() else workdir / "metrics.jsonl"
    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no metrics records yet; plot after the run has "
                         "written at least one step.")
    series = _series(records)
    panels = [(stem, title, ylabel, sorted(k for k in series if match(k)))
              for stem, title, ylabel, match in PANELS]
    panels = [panel for panel in panels if panel[3]]
    if not panels:
        raise ValueError(f"{metrics_path} has no plotted keys (found {sorted(series)}); the plots "
                         "read reward, success, tool_calls, kl, entropy, *_loss and *_time keys.")

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out) if out is not None else metrics_path.parent / DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)

    def draw(axes, title, ylabel, keys):
        for key in keys:
            steps, values = series[key]
            if smooth and len(steps) >= 20:
                (line,) = axes.plot(steps, values, alpha=0.25, linewidth=1)
                axes.plot(steps, smoothed(values, smooth), label=key, color=line.get_color())
            else:
                axes.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")

    written = []
    for stem, title, ylabel, keys in panels:
        figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
        draw(axes, title, ylabel, keys)
        figure.tight_layout()
        path = out_dir / f"{stem}.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), dpi=100,
                                squeeze=False)
    for axes, (_, title, ylabel, keys) in zip(grid.flat, panels, strict=False):
        draw(axes, title, ylabel, keys)
    for axes in list(grid.flat)[len(panels):]:
        axes.set_visible(False)
    figure.suptitle(f"{metrics_path.parent.name}: {len(records)} records, "
                    f"steps {records[0]['step']}–{records[-1]['step']}")
    figure.tight_layout()
    path = out_dir / "curves.png"
    figure.savefig(path)
    plt.close(figure)
    written.append(path)
    return written


def add_plot_arguments(parser) -> None:
    parser.add_argument("workdir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None,
                        help=f"output directory for the PNGs (default WORKDIR/{DEFAULT_OUT})")
    parser.add_argument("--smooth", type=float, default=0.6,
                        help="EMA smoothing weight in [0, 1) for long series (0: raw only)")


def plot_main(args) -> int:
    import sys

    try:
        paths = plot_metrics(args.workdir, args.out, smooth=args.smooth)
    except ImportError as error:
        print(f"agentrl plot: needs matplotlib ({error}); `pip install matplotlib`.",
              file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as error:
        print(f"agentrl plot: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"agentrl plot: wrote {path}")
    return 0
