"""Show that memory stays flat over a long tiny run of the real async GRPO pipeline.

The script launches ``python -m grpo run async_grpo --config tiny_arithmetic_cpu`` in a child
process (``orchestration.num_steps=--steps``, ``eval_every_n_steps=null``,
``WANDB_MODE=disabled``, a fresh ``output_dir``) and, every ``--interval`` seconds, samples
the memory of that driver and of every process below it, found with psutil:

- Ray actors by their process title (``ray::SyncLLMCollector``, ``ray::RefActor``,
  ``ray::PyTorchActorModel``, ``ray::ReplayBuffer``, ``ray::MetricLogger``,
  ``ray::_RolloutQueueActor`` for the rollout queue); several processes of one class are summed.
- Processes started by an actor (the reward pool's forkserver and workers under the
  ``RefActor``) count as ``<Actor> children``: workers are replaced after a timeout, so their
  pids change but the group stays comparable.
- Ray's pre-started ``ray::IDLE`` workers, ``raylet`` (which holds the object store, so a
  leak of objects shows there), ``gcs_server`` and Ray's Python agents each form a group.

Per process it records RSS, and USS and PSS from ``memory_full_info`` (``smaps_rollup``;
cheap). The run's ``metrics.jsonl`` maps time to training step. At the end it prints, per
group and for the total, RSS at the first sample at or after ``--warmup-steps``, at the
middle and at the last training step, the growth, and a least-squares slope of RSS against
step over the post-warm-up samples, with a verdict (rule printed with the table); then the
replay-buffer and rollout-queue sizes from the metrics, to show they are bounded. The raw
samples go to a CSV next to the run folder.

Sums of RSS count shared pages (torch's libraries, Ray's shared-memory object store) once per
process; the PSS total splits them and is the better estimate of what the run occupies.

The model is ``--model-dir``, else ``assets/tiny_arithmetic_qwen2`` if it exists, else a random
Qwen2 of the demo model's shape built with `grpo.testing.build_tiny_qwen2` (a random policy
earns no reward and writes full-length responses, but every step does the same work).

Usage:
    python scripts/bench_memory.py              # 150 steps
    python scripts/bench_memory.py --quick      # 40 steps
    python scripts/bench_memory.py --steps 300 --interval 5 --out-dir /tmp/mem_run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from bench_common import load_average, print_table

from grpo.config import repo_root
from grpo.observability.metric_names import (
    REPLAY_BUFFER_SIZE,
    ROLLOUT_QUEUE_SIZE,
    TRAIN_PERF_TOTAL_STEP_TIME,
)

CONFIG = "tiny_arithmetic_cpu"
# Shape of the shipped demo model (scripts/build_tiny_arithmetic_model.py defaults).
TINY_MODEL_SHAPE = {
    "num_layers": 4,
    "embed_dim": 128,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_dim": 512,
}
# Verdict rule: flat if the fitted growth per 100 steps is below either bound.
FLAT_FRACTION = 0.02
FLAT_MB = 20.0
MB = 2**20
# A Ray worker process before it retitles itself ray::IDLE / ray::Class.
RAY_WORKER_SCRIPT = "ray/_private/workers/default_worker.py"


# ------------------------------------------------------------------ processes


def ray_title(cmdline: list[str]) -> str | None:
    """``"RefActor"`` for a Ray worker titled ``ray::RefActor`` or ``ray::RefActor.score``.

    Ray rewrites a worker's argv to ``ray::Class`` (``ray::Class.method`` while a method
    runs, ``ray::IDLE`` before it hosts anything); other processes return None.
    """
    title = " ".join(cmdline).strip()
    if not title.startswith("ray::"):
        return None
    name = title[len("ray::") :].split()[0] if len(title) > len("ray::") else "IDLE"
    return name.split(".")[0].split("(")[0] or "IDLE"


def own_group(process: psutil.Process, cmdline: list[str]) -> str | None:
    """The group a process forms on its own, or None if it belongs to its parent's."""
    actor = ray_title(cmdline)
    if actor == "IDLE":
        return "ray::IDLE workers"
    if actor is not None:
        return f"ray::{actor}"
    name = process.name()
    if name in ("raylet", "gcs_server"):
        return name
    # Judge by the script run, not the whole command line: a forkserver's command line holds
    # sys.path, which names Ray's folders too.
    scripts = [arg for arg in cmdline[1:] if arg.endswith(".py")]
    if any(script.endswith(RAY_WORKER_SCRIPT) for script in scripts):
        return "ray::IDLE workers"
    # Ray's Python daemons: dashboard, dashboard agent, log monitor, autoscaler monitor.
    if any("/ray/" in script for script in scripts):
        return "ray agents"
    return None


def short_title(cmdline: list[str]) -> str:
    """``ray::RefActor.score``, ``raylet``, ``python log_monitor.py``: enough to tell them apart."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0]
    words = [Path(cmdline[0]).name]
    for arg in cmdline[1:]:
        if arg.endswith(".py"):
            words.append(Path(arg).name)
            break
        if arg.startswith("from ") or arg.startswith("import "):
            words.append(arg.split(";")[0])
            break
    return " ".join(words)


def group_of(process: psutil.Process, cmdline: list[str], driver_pid: int) -> str:
    """Group of a process: its own (an actor, raylet...), or ``<nearest group> children``."""
    group = own_group(process, cmdline)
    if group is not None:
        return group
    try:
        for ancestor in process.parents():
            if ancestor.pid == driver_pid:
                break
            ancestor_group = own_group(ancestor, ancestor.cmdline())
            if ancestor_group is not None:
                return f"{ancestor_group} children"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return "other"


@dataclass
class ProcessSample:
    time: float
    pid: int
    group: str
    title: str
    rss_mb: float
    uss_mb: float
    pss_mb: float


def sample_processes(driver: psutil.Process) -> list[ProcessSample]:
    """Memory of the driver and of every descendant; processes that vanish are skipped."""
    now = time.time()
    try:
        processes = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    samples = []
    for process in processes:
        try:
            with process.oneshot():
                cmdline = process.cmdline()
                info = process.memory_full_info()
            if process.pid == driver.pid:
                group = "driver"
            else:
                group = group_of(process, cmdline, driver.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        samples.append(
            ProcessSample(
                time=now,
                pid=process.pid,
                group=group,
                title=short_title(cmdline),
                rss_mb=info.rss / MB,
                uss_mb=info.uss / MB,
                pss_mb=info.pss / MB,
            )
        )
    return samples


# ------------------------------------------------------------------ the run


def resolve_model_dir(model_dir: Path | None, work_dir: Path) -> tuple[Path, str]:
    """The model folder to run, and a line that says what it is."""
    if model_dir is not None:
        return model_dir.resolve(), f"{model_dir} (--model-dir)"
    shipped = repo_root() / "assets" / "tiny_arithmetic_qwen2"
    if shipped.is_dir():
        return shipped, f"{shipped} (shipped demo model)"
    from grpo.testing import build_tiny_qwen2  # imports torch; only needed here

    built = build_tiny_qwen2(work_dir / "tiny_random_qwen2", **TINY_MODEL_SHAPE)
    shape = ", ".join(f"{key}={value}" for key, value in TINY_MODEL_SHAPE.items())
    return built, f"random tiny Qwen2 ({shape}; {shipped} does not exist)"


class MetricsTail:
    """Reads the complete lines appended to ``metrics.jsonl`` since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rows: list[dict[str, Any]] = []

    def read(self) -> None:
        """Append the rows written since the last call to `rows`."""
        if not self.path.is_file():
            return
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            data = file.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self.rows.append(json.loads(line))

    def train_rows(self) -> list[dict[str, Any]]:
        return sorted(
            (r for r in self.rows if TRAIN_PERF_TOTAL_STEP_TIME in r), key=lambda r: r["step"]
        )


def stop_process_tree(driver: psutil.Process, grace_s: float = 60.0) -> None:
    """SIGTERM the driver (it shuts its actors down), then SIGKILL whatever is left."""
    try:
        tree = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    try:
        driver.send_signal(signal.SIGTERM)
        driver.wait(grace_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        pass
    for process in tree:  # psutil checks the pid still names the same process
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def run_and_sample(
    model_dir: Path, run_dir: Path, steps: int, interval_s: float, timeout_s: float
) -> tuple[list[ProcessSample], MetricsTail, int | None, float]:
    """Run the recipe in a child process and sample memory until it exits.

    Returns:
        tuple: The samples, the run's metrics, the exit code (None on timeout), wall seconds.
    """
    overrides = [
        f"base_model_path={model_dir}",
        f"output_dir={run_dir}",
        f"orchestration.num_steps={steps}",
        "eval_every_n_steps=null",  # memory of the step loop only
    ]
    command = [sys.executable, "-m", "grpo", "run", "async_grpo", "--config", CONFIG, *overrides]
    env = {**os.environ, "WANDB_MODE": "disabled", "VLLM_LOGGING_LEVEL": "WARNING"}
    log_path = run_dir.parent / "run.log"
    print(f"run log: {log_path}")
    metrics = MetricsTail(run_dir / "metrics.jsonl")
    samples: list[ProcessSample] = []
    start = time.monotonic()
    last_report = start
    timed_out = False
    with open(log_path, "w") as log_file:
        child = subprocess.Popen(
            command, cwd=repo_root(), env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
        driver = psutil.Process(child.pid)
        try:
            while child.poll() is None:
                tick = time.monotonic()
                if tick - start > timeout_s:
                    print(f"timed out after {timeout_s:.0f} s; stopping the run", flush=True)
                    timed_out = True
                    stop_process_tree(driver)
                    break
                batch = sample_processes(driver)
                samples.extend(batch)
                metrics.read()
                if tick - last_report >= 30 and batch:
                    last_report = tick
                    train = metrics.train_rows()
                    step = train[-1]["step"] if train else 0
                    print(
                        f"  {tick - start:6.0f} s  step {step:4d}/{steps}  "
                        f"{len(batch)} processes  total RSS {sum(s.rss_mb for s in batch):7.0f}"
                        f" MB  PSS {sum(s.pss_mb for s in batch):7.0f} MB",
                        flush=True,
                    )
                time.sleep(max(0.0, interval_s - (time.monotonic() - tick)))
        except BaseException:  # Ctrl-C or a bug here: never leave the run behind
            stop_process_tree(driver)
            raise
        child.wait()
    metrics.read()
    returncode = None if timed_out else child.returncode
    return samples, metrics, returncode, time.monotonic() - start


# ------------------------------------------------------------------ analysis


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (0 when ``xs`` does not vary)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if var_x == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x


def step_at(train_times: list[tuple[float, int]], t: float) -> int:
    """Training step reached at time ``t``: the last step logged at or before it."""
    step = 0
    for logged, logged_step in train_times:
        if logged > t:
            break
        step = logged_step
    return step


def group_series(samples: list[ProcessSample]) -> dict[str, dict[float, dict[str, float]]]:
    """Per group and sample time: summed rss/uss/pss and the process count."""
    series: dict[str, dict[float, dict[str, float]]] = defaultdict(dict)
    for s in samples:
        for group in (s.group, "TOTAL"):
            point = series[group].setdefault(s.time, {"rss": 0.0, "uss": 0.0, "pss": 0.0, "n": 0})
            point["rss"] += s.rss_mb
            point["uss"] += s.uss_mb
            point["pss"] += s.pss_mb
            point["n"] += 1
    return series


def write_csv(path: Path, samples: list[ProcessSample], train_times: list[tuple[float, int]]):
    start = samples[0].time if samples else 0.0
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["time", "elapsed_s", "step", "pid", "group", "title", "rss_mb", "uss_mb", "pss_mb"]
        )
        for s in samples:
            writer.writerow(
                [
                    f"{s.time:.3f}",
                    f"{s.time - start:.1f}",
                    step_at(train_times, s.time),
                    s.pid,
                    s.group,
                    s.title,
                    f"{s.rss_mb:.1f}",
                    f"{s.uss_mb:.1f}",
                    f"{s.pss_mb:.1f}",
                ]
            )


def report(
    samples: list[ProcessSample], train_rows: list[dict[str, Any]], warmup_steps: int
) -> None:
    """Print the per-group memory table over the post-warm-up training window."""
    train_times = [(r["time"], r["step"]) for r in train_rows]
    last_step, end_time = train_rows[-1]["step"], train_rows[-1]["time"]
    middle_step = (warmup_steps + last_step) // 2
    # The window ends at the last training step: saving the final model and shutting down
    # come after it and are not part of the steady state.
    window_times = sorted(
        {
            s.time
            for s in samples
            if s.time <= end_time and step_at(train_times, s.time) >= warmup_steps
        }
    )
    if len(window_times) < 2:
        print(
            f"only {len(window_times)} memory samples between step {warmup_steps} and the last "
            f"step {last_step}; lower --interval or --warmup-steps, or raise --steps"
        )
        return
    steps_of = {t: step_at(train_times, t) for t in window_times}
    series = group_series(samples)
    order = sorted(series, key=lambda g: (g == "TOTAL", g != "driver", g))
    rows, verdicts = [], []
    for group in order:
        points = [(t, series[group][t]) for t in window_times if t in series[group]]
        if len(points) < 2:
            continue
        first = points[0]
        middle = next((p for p in points if steps_of[p[0]] >= middle_step), points[-1])
        last = points[-1]
        xs = [float(steps_of[t]) for t, _ in points]
        rss = [p["rss"] for _, p in points]
        rss_per_100 = 100.0 * slope(xs, rss)
        # Growth that settles (allocator pools filling up) shows as a smaller late slope.
        half = len(points) // 2
        late_per_100 = 100.0 * slope(xs[half:], rss[half:]) if len(points) >= 4 else rss_per_100
        uss_per_100 = 100.0 * slope(xs, [p["uss"] for _, p in points])
        bound = max(FLAT_FRACTION * last[1]["rss"], FLAT_MB)
        flat = rss_per_100 < bound
        counts = [int(p["n"]) for _, p in points]
        # Idle workers and reward workers come and go: a range says the sum is not one process.
        procs = f"{min(counts)}-{max(counts)}" if min(counts) != max(counts) else str(counts[0])
        rows.append(
            [
                group,
                procs,
                f"{first[1]['rss']:.0f} @{steps_of[first[0]]}",
                f"{middle[1]['rss']:.0f} @{steps_of[middle[0]]}",
                f"{last[1]['rss']:.0f} @{steps_of[last[0]]}",
                f"{last[1]['rss'] - first[1]['rss']:+.1f}",
                f"{rss_per_100:+.1f}",
                f"{late_per_100:+.1f}",
                f"{last[1]['uss']:.0f}",
                f"{uss_per_100:+.1f}",
                "flat" if flat else "GROWING",
            ]
        )
        verdicts.append(
            f"  {group}: {'flat' if flat else 'GROWING'} (RSS {rss_per_100:+.1f} MB / 100 steps, "
            f"bound {bound:.1f} MB)"
        )
    print_table(
        f"Memory per group, MB (RSS @step), steps {steps_of[window_times[0]]}..{last_step}, "
        f"{len(window_times)} samples after the warm-up",
        [
            "group",
            "procs",
            "RSS start",
            "RSS middle",
            "RSS end",
            "growth",
            "RSS/100 steps",
            "2nd half/100",
            "USS end",
            "USS/100 steps",
            "verdict",
        ],
        rows,
    )
    total = series["TOTAL"]
    pss = [total[t]["pss"] for t in window_times]
    pss_per_100 = 100.0 * slope([float(steps_of[t]) for t in window_times], pss)
    print(
        f"\n  TOTAL PSS (shared pages split between processes): {pss[0]:.0f} MB at the start, "
        f"{pss[-1]:.0f} MB at the end, {pss_per_100:+.1f} MB / 100 steps"
    )
    print(
        f"\nVerdict rule: flat if the least-squares RSS growth per 100 steps (fitted over the "
        f"samples from step {warmup_steps} to the last step) is < {FLAT_FRACTION:.0%} of the "
        f"group's RSS at the end or < {FLAT_MB:.0f} MB; otherwise GROWING. '2nd half' is "
        "the same fit over the later half of the samples. USS (pages only that process maps) "
        "is shown for reference: it also rises when a process that shared "
        "pages with it exits."
    )
    print("\n".join(verdicts))


def report_queues(train_rows: list[dict[str, Any]], run_dir: Path, warmup_steps: int) -> None:
    """Replay-buffer and rollout-queue sizes over the run, next to their capacities."""
    capacities: dict[str, Any] = {}
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(config_path)
        capacities = {
            REPLAY_BUFFER_SIZE: cfg.orchestration.replay_buffer_size,
            ROLLOUT_QUEUE_SIZE: cfg.inference.queue_maxsize,
        }
    rows = []
    for key in (REPLAY_BUFFER_SIZE, ROLLOUT_QUEUE_SIZE):
        values = [(r["step"], r[key]) for r in train_rows if r.get(key) is not None]
        if not values:
            rows.append([key, "-", "-", "-", "-", "-", capacities.get(key, "?")])
            continue
        after = [v for s, v in values if s >= warmup_steps] or [v for _, v in values]
        middle = values[len(values) // 2]
        rows.append(
            [
                key,
                f"{values[0][1]:.0f} @{values[0][0]}",
                f"{middle[1]:.0f} @{middle[0]}",
                f"{values[-1][1]:.0f} @{values[-1][0]}",
                f"{max(after):.0f}",
                f"{sum(after) / len(after):.1f}",
                capacities.get(key, "?"),
            ]
        )
    print_table(
        f"Queue sizes from metrics.jsonl (max and mean from step {warmup_steps} on)",
        ["metric", "first", "middle", "end", "max", "mean", "capacity"],
        rows,
    )


# ------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 150)")
    parser.add_argument("--quick", action="store_true", help="40 steps unless --steps is given")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="steps before the measured window"
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where run/, run.log and the CSV go (new temp)"
    )
    parser.add_argument("--timeout-min", type=float, default=60.0, help="stop the run after this")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    steps = args.steps if args.steps is not None else (40 if args.quick else 150)
    if steps <= args.warmup_steps + 1:
        raise SystemExit(f"--steps ({steps}) must exceed --warmup-steps ({args.warmup_steps}) + 1")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bench_memory_"))
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / "run"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; pass a new --out-dir")
    print(f"load average at start: {load_average()}")
    model_dir, model_line = resolve_model_dir(args.model_dir, out_dir)
    print(f"model: {model_line}")
    print(f"run: {CONFIG}, {steps} steps, sampling every {args.interval:g} s, out {out_dir}")

    samples, metrics, returncode, seconds = run_and_sample(
        model_dir, run_dir, steps, args.interval, args.timeout_min * 60
    )
    train_rows = metrics.train_rows()
    print(f"\nrun took {seconds:.0f} s, exit code {returncode}, {len(train_rows)} training steps")
    csv_path = out_dir / "memory_samples.csv"
    write_csv(csv_path, samples, [(r["time"], r["step"]) for r in train_rows])
    print(f"raw samples: {csv_path} ({len(samples)} rows)")
    titles: dict[str, set[str]] = defaultdict(set)
    for s in samples:
        titles[s.group].add(s.title.split(".")[0] if s.title.startswith("ray::") else s.title)
    print("process groups seen:")
    for group, names in sorted(titles.items()):
        print(f"  {group}: {', '.join(sorted(names))}")
    if returncode != 0:
        tail = (out_dir / "run.log").read_text(errors="replace")[-3000:]
        print(f"\nthe run failed; end of {out_dir / 'run.log'}:\n{tail}", file=sys.stderr)
    if train_rows and train_rows[-1]["step"] > args.warmup_steps:
        report(samples, train_rows, args.warmup_steps)
        report_queues(train_rows, run_dir, args.warmup_steps)
    else:
        print(f"not enough training steps after the warm-up ({args.warmup_steps}) to report")
    print(f"\nload average at end: {load_average()}")
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
