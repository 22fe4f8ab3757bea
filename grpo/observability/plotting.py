"""Plots of a run from its ``metrics.jsonl``, no W&B needed.

`plot_run` draws the first curves one looks at in a GRPO run into ``RUN_DIR/plots/*.png``, each
series raw (faint) with a moving average, against its actor's own step, standing values only
(after a rewind). Uses matplotlib's Agg canvas without pyplot, so it needs no display and
leaves the process's backend alone.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    INFERENCE_EPISODE_ENV_TOKEN_FRACTION,
    INFERENCE_EPISODE_TRUNCATED,
    INFERENCE_EPISODE_TURNS_MEAN,
    INFERENCE_TOKENS_PER_SECOND,
    INFERENCE_TOOL_CALLS_PER_EPISODE,
    INFERENCE_TOOL_ERRORS,
    RESERVED_KEYS,
    REWARDS_FUNC_MEAN_TEMPLATE,
    SUCCESSES_FUNC_MEAN_TEMPLATE,
    TRAIN_APPROX_POLICY_KLS,
    TRAIN_KL_LOSS,
    TRAIN_PERF_TOKENS_PER_SECOND,
    TRAIN_POLICY_AGE_MAX,
    TRAIN_POLICY_AGE_MEAN,
    TRAIN_RESPONSE_LENGTHS,
    step_metric_for,
)
from grpo.observability.metrics import records_after_rewinds

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: which metrics go in it and how.

    Args:
        filename (str): File name without ``.png``.
        patterns (tuple[str, ...]): Metric names or globs (``*``); matching series are drawn in
            the order of the patterns, then by name.
        one_panel_per_series (bool): Stack one panel per series (series with different scales
            or step axes) instead of sharing one axes.
    """

    filename: str
    title: str
    ylabel: str
    patterns: tuple[str, ...]
    one_panel_per_series: bool = False


# The metric names are `grpo.observability.metric_names.METRIC_NAMES` entries (a test checks it).
PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec(
        "rewards_per_function",
        "Training reward per reward function (mean over the ref actor's batch)",
        "mean reward",
        (REWARDS_FUNC_MEAN_TEMPLATE.format(name="*"),),
    ),
    PlotSpec(
        "successes_per_function",
        "Training success rate per reward function",
        "success rate",
        (SUCCESSES_FUNC_MEAN_TEMPLATE.format(name="*"),),
    ),
    PlotSpec("eval_accuracy", "Held-out accuracy", "accuracy", (EVAL_ACCURACY,)),
    PlotSpec(
        "kl",
        "KL to the reference policy",
        "KL",
        (TRAIN_KL_LOSS, TRAIN_APPROX_POLICY_KLS),
        one_panel_per_series=True,
    ),
    PlotSpec(
        "response_length",
        "Mean response length (training batch)",
        "tokens",
        (TRAIN_RESPONSE_LENGTHS,),
    ),
    PlotSpec(
        "tokens_per_second",
        "Throughput",
        "tokens / s",
        (TRAIN_PERF_TOKENS_PER_SECOND, INFERENCE_TOKENS_PER_SECOND),
        one_panel_per_series=True,
    ),
    PlotSpec(
        "episodes",
        "Multi-turn episodes (per generation batch: means per episode, counts per batch)",
        "value",
        (
            INFERENCE_EPISODE_TURNS_MEAN,
            INFERENCE_TOOL_CALLS_PER_EPISODE,
            INFERENCE_TOOL_ERRORS,
            INFERENCE_EPISODE_ENV_TOKEN_FRACTION,
            INFERENCE_EPISODE_TRUNCATED,
        ),
        one_panel_per_series=True,
    ),
    PlotSpec(
        "policy_age",
        "Policy age of trained samples (trainer version - generating version)",
        "versions",
        (TRAIN_POLICY_AGE_MEAN, TRAIN_POLICY_AGE_MAX),
    ),
)


def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Read a run's ``metrics.jsonl`` into one ``(step, value)`` list per metric.

    Only numbers are kept, in file order (actors' steps interleave; sort to plot), and only
    standing values (after a rewind). A truncated last line, as a killed run can leave, is
    skipped with a warning.

    Args:
        run_dir (str | Path): The run folder, or the ``metrics.jsonl`` path itself.

    Returns:
        dict[str, list[tuple[int, float]]]: Metric name -> ``[(step, value), ...]``.

    Raises:
        FileNotFoundError: If there is no ``metrics.jsonl`` (the message names the path).
        ValueError: If a line other than the last is not a JSON object with an int ``step``.
    """
    path = Path(run_dir)
    if path.is_dir() or path.suffix != ".jsonl":
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no metrics file at {path}: expected the {METRICS_FILE} that MetricLogger writes "
            "in the run folder"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a JSON object with an int 'step'")
        except ValueError as error:  # JSONDecodeError is a ValueError
            if line_number == len(lines):
                log.warning("%s:%d: skipping a truncated last line (%s)", path, line_number, error)
                continue
            raise ValueError(f"{path}:{line_number}: bad metrics record: {error}") from error
        records.append(record)
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records_after_rewinds(records):
        for key, value in record.items():
            if key in RESERVED_KEYS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, []).append((record["step"], float(value)))
    return series


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Centred moving average; the window shrinks at the ends so the output keeps the length.

    Raises:
        ValueError: If `window` < 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    array = np.asarray(values, dtype=np.float64)
    if window == 1 or array.size == 0:
        return array.copy()
    # Window [i - before, i + after] clipped to the series; sums from one cumulative sum.
    before, after = (window - 1) // 2, window // 2
    cumsum = np.concatenate([[0.0], np.cumsum(array)])
    index = np.arange(array.size)
    lo = np.clip(index - before, 0, array.size)
    hi = np.clip(index + after + 1, 0, array.size)
    return (cumsum[hi] - cumsum[lo]) / (hi - lo)


def default_smoothing_window(num_points: int) -> int:
    """Light smoothing: about a tenth of the series, at most 25 points, none below 20 points."""
    return max(1, min(num_points // 10, 25))


def plot_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    smoothing_window: int | None = None,
) -> list[Path]:
    """Write the standard plots of a run as PNGs.

    A plot whose metrics are all absent from the log (no eval configured, an older run) is
    skipped, and each skip is logged at INFO level with the metrics it looked for.

    Args:
        out_dir (str | Path | None): Where to write; ``run_dir/plots`` by default.
        smoothing_window (int | None): Moving-average window; None picks one per series
            (`default_smoothing_window`).

    Returns:
        list[Path]: The PNG files written, in the order of `PLOTS`.

    Raises:
        FileNotFoundError: If ``run_dir/metrics.jsonl`` does not exist.
    """
    series = read_metrics(run_dir)
    out_path = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out_path.mkdir(parents=True, exist_ok=True)

    written = []
    for spec in PLOTS:
        matched = _match(spec.patterns, series)
        if not matched:
            log.info(
                "skipping plot %s: none of %s in %s",
                spec.filename,
                list(spec.patterns),
                Path(run_dir) / METRICS_FILE,
            )
            continue
        path = out_path / f"{spec.filename}.png"
        _draw(spec, matched, series, path, smoothing_window)
        written.append(path)
    return written


def _match(patterns: Sequence[str], series: dict[str, list]) -> list[tuple[str, str]]:
    """``(metric name, legend label)`` of every series matching one of `patterns`."""
    matched, seen = [], set()
    for pattern in patterns:
        for key in sorted(series):
            if key in seen or not fnmatch.fnmatchcase(key, pattern):
                continue
            seen.add(key)
            if "*" in pattern:
                # The part the glob matched: the reward function's name.
                head, _, tail = pattern.partition("*")
                label = key[len(head) : len(key) - len(tail)]
            else:
                label = key.rsplit("/", 1)[-1]
            matched.append((key, label))
    return matched


def _draw(
    spec: PlotSpec,
    matched: list[tuple[str, str]],
    series: dict[str, list[tuple[int, float]]],
    path: Path,
    smoothing_window: int | None,
) -> None:
    from matplotlib.figure import Figure

    groups = [[item] for item in matched] if spec.one_panel_per_series else [matched]
    figure = Figure(figsize=(8, 3.2 * len(groups) + 0.6), layout="constrained")
    axes_list = figure.subplots(len(groups), 1, squeeze=False)[:, 0]
    figure.suptitle(spec.title)
    # Matplotlib's default cycle, indexed so raw points and their average share a colour.
    colors = [f"C{i}" for i in range(10)]

    series_index = 0  # across panels, so each series keeps its own colour
    for axes, group in zip(axes_list, groups):
        for key, label in group:
            points = sorted(series[key], key=lambda point: point[0])
            steps = np.array([step for step, _ in points])
            values = np.array([value for _, value in points])
            window = smoothing_window or default_smoothing_window(len(values))
            color = colors[series_index % len(colors)]
            series_index += 1
            if window > 1:
                axes.plot(
                    steps, values, color=color, alpha=0.3, linewidth=0.8, marker=".", markersize=3
                )
                axes.plot(
                    steps,
                    moving_average(values, window),
                    color=color,
                    linewidth=1.8,
                    label=f"{label} (avg {window})",
                )
            else:
                axes.plot(
                    steps, values, color=color, linewidth=1.5, marker=".", markersize=5, label=label
                )
        axes.set_xlabel(step_metric_for(group[0][0]))
        axes.set_ylabel(spec.ylabel)
        if spec.one_panel_per_series:
            axes.set_title(group[0][0], fontsize=9)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8, loc="best")
    figure.savefig(path, dpi=110)
