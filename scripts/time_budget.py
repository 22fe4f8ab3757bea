"""Where a run's wall time goes: the trainer's critical path, what ran beside it, and how much
of training overlapped generation, read from a finished run's ``metrics.jsonl``.

The window is from the end of step ``--warmup-steps`` to the end of the last step (start-up
and compilation left out). Shares are of the window's wall time:

* the trainer's critical path, whose parts add up to the wall time: waiting for a batch,
  train compute (the forward/backward/optimizer steps, and packing and the rest of
  ``train_step``), weight sync (gather, transfer, engine reload), and driver bookkeeping (the
  remainder: Ray round trips of the step's calls, the batch's (de)serialisation, logging);
* what ran beside it, per actor: the collectors' generation and weight updates, the reference
  actors' forwards and their whole scoring calls (busy seconds over wall seconds; with several
  collectors the share can pass 100%);
* overlap: the share of the trainer's compute time during which at least one collector was
  generating (1.0: training hid entirely behind generation, or the reverse).

Usage:
    python scripts/time_budget.py outputs/tiny_arithmetic_cpu
    python scripts/time_budget.py RUN_DIR --warmup-steps 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.observability import metric_names as names  # noqa: E402


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: give the folder of a finished run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def merged_length(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Seconds of ``spans`` inside the union ``cover`` (disjoint, sorted)."""
    total = 0.0
    for start, end in spans:
        for c_start, c_end in cover:
            total += max(0.0, min(end, c_end) - max(start, c_start))
    return total


def budget(rows: list[dict], warmup_steps: int) -> dict[str, float]:
    """The shares of the window's wall time (see the module docstring)."""
    steps = {}
    for row in rows:
        if names.TRAIN_PERF_STEP_WALL_TIME in row:
            steps[row["step"]] = row  # a redone step's last row stands
    if len(steps) <= warmup_steps + 1:
        raise SystemExit(f"the run has {len(steps)} steps: too few after {warmup_steps} warm-up")
    ordered = [steps[s] for s in sorted(steps)]
    start, end = ordered[warmup_steps]["time"], ordered[-1]["time"]
    measured = ordered[warmup_steps + 1 :]
    wall = end - start

    def total(key: str, among: list[dict]) -> float:
        return sum(row.get(key, 0.0) for row in among)

    inside = [r for r in rows if start < r["time"] <= end]
    collector_rows = [r for r in inside if names.INFERENCE_TIME_GENERATION in r]
    ref_rows = [r for r in inside if names.REF_PERF_TOTAL_ROLLOUT_TIME in r]
    generation = [
        (r["time"] - r[names.INFERENCE_TIME_GENERATION], r["time"]) for r in collector_rows
    ]
    compute = []
    for row in measured:
        begun = row["time"] - row[names.TRAIN_PERF_STEP_WALL_TIME]
        computing = begun + row.get(names.TRAIN_PERF_TIME_WAITING_BUFFER, 0.0)
        compute.append((computing, computing + row[names.TRAIN_PERF_TIME_TRAIN_COMPUTE]))
    compute_s = sum(b - a for a, b in compute)
    gather = total(names.TRAIN_PERF_TIME_WEIGHT_GATHER, measured)
    transfer = total(names.TRAIN_PERF_TIME_WEIGHT_TRANSFER, measured)
    reload = total(names.TRAIN_PERF_TIME_ENGINE_RELOAD, measured)
    train = total(names.TRAIN_PERF_TIME_TRAIN_COMPUTE, measured)
    grpo_steps = total(names.TRAIN_PERF_TIME_GRPO_STEPS, measured)
    return {
        "steps": float(len(measured)),
        "wall_s": wall,
        "s_per_step": wall / len(measured),
        "waiting for the batch": total(names.TRAIN_PERF_TIME_WAITING_BUFFER, measured) / wall,
        "train compute": train / wall,
        "  forward, backward, optimizer": grpo_steps / wall,
        "  packing and the rest": (train - grpo_steps) / wall,
        "weight sync": (gather + transfer + reload) / wall,
        "  gather": gather / wall,
        "  transfer": transfer / wall,
        "  engine reload": reload / wall,
        "driver bookkeeping (Ray, serialisation)": total(
            names.TRAIN_PERF_TIME_DRIVER_OVERHEAD, measured
        )
        / wall,
        "generation (collectors)": total(names.INFERENCE_TIME_GENERATION, collector_rows) / wall,
        "weight updates (collectors)": total(names.INFERENCE_TIME_WEIGHT_UPDATE, collector_rows)
        / wall,
        "reference forward": total(names.REF_PERF_TIME_MODEL_RUNNING, ref_rows) / wall,
        "scoring calls (reference)": total(names.REF_PERF_TOTAL_ROLLOUT_TIME, ref_rows) / wall,
        "overlap": overlap(compute, merged_length(generation)) / compute_s if compute_s else 0.0,
    }


CRITICAL = (
    "waiting for the batch",
    "train compute",
    "  forward, backward, optimizer",
    "  packing and the rest",
    "weight sync",
    "  gather",
    "  transfer",
    "  engine reload",
    "driver bookkeeping (Ray, serialisation)",
)
BESIDE = (
    "generation (collectors)",
    "weight updates (collectors)",
    "reference forward",
    "scoring calls (reference)",
)


def print_budget(label: str, shares: dict[str, float]) -> None:
    print(
        f"{label}: {shares['steps']:.0f} steps in {shares['wall_s']:.1f} s "
        f"({shares['s_per_step']:.3f} s/step)"
    )
    print("  the trainer's critical path (share of wall time):")
    for key in CRITICAL:
        print(f"    {key:<42} {100 * shares[key]:6.1f}%")
    print("  beside it (busy time over wall time):")
    for key in BESIDE:
        print(f"    {key:<42} {100 * shares[key]:6.1f}%")
    print(f"  train compute overlapped by generation        {100 * shares['overlap']:6.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="folders of finished runs")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out first")
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        print_budget(str(run_dir), budget(read_rows(run_dir), args.warmup_steps))


if __name__ == "__main__":
    main()
