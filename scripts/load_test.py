"""Load test: the demo, run back to back while CPU-bound processes keep the machine busy.

A run that finishes on a quiet machine can still stop on a busy one: a timeout that is long
enough at full speed is too short when the run gets a tenth of the CPU (Ray starts its actor
processes at nice 15). This script starts ``--load`` x (CPU count) busy-looping processes,
at nice 15 by default (the niceness of Ray's actors: the run competes with them on equal
terms, as with a second run or a test suite beside it; at nice 0 each actor gets about 2% of
a core and the demo barely moves), runs
``grpo run async_grpo --config tiny_arithmetic_cpu`` ``--runs`` times one after another, and
prints for each run whether it finished every step, its exit status, the steps it reached,
its wall time, the faults it survived (`faults/actor_restarts`, `faults/steps_redone`), and
the load average. A run that did not finish prints the last lines of its terminal output.

Usage:
    python scripts/load_test.py                        # 5 runs of 1000 steps at 3x load
    python scripts/load_test.py --runs 2 --steps 200   # shorter
    python scripts/load_test.py --load 0               # the same runs on a quiet machine
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import load_average, print_table

from grpo.config import repo_root
from grpo.observability.metric_names import FAULTS_ACTOR_RESTARTS, FAULTS_STEPS_REDONE
from grpo.observability.metrics import records_after_rewinds
from grpo.testing import read_jsonl


def busy_loop(nice: int) -> None:
    """Burn one CPU, at niceness ``nice``, until killed."""
    os.nice(nice - os.nice(0))
    while True:
        pass


def start_load(processes: int, nice: int) -> list[multiprocessing.Process]:
    """``processes`` busy loops, as daemons (they die with this script)."""
    hogs = [
        multiprocessing.Process(target=busy_loop, args=(nice,), daemon=True)
        for _ in range(processes)
    ]
    for hog in hogs:
        hog.start()
    return hogs


def records(path: Path) -> list[dict[str, Any]]:
    """A run's JSON-lines file; none when the run stopped before writing it."""
    return read_jsonl(path) if path.is_file() else []


def one_run(run_dir: Path, steps: int, seed: int, timeout_s: float) -> dict[str, Any]:
    """Run the demo into ``run_dir``; what it reached and how it ended."""
    command = [
        *(sys.executable, "-m", "grpo", "run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
        f"output_dir={run_dir}",
        f"seed={seed}",
        f"orchestration.num_steps={steps}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=repo_root(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        exit_code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:
        exit_code = "timeout"
        output = (timeout.stdout or b"").decode() + (timeout.stderr or b"").decode()
    seconds = time.monotonic() - started
    trained = records_after_rewinds(records(run_dir / "trained.jsonl"))
    metrics = records(run_dir / "metrics.jsonl")

    def last(key: str) -> float:
        values = [m[key] for m in metrics if key in m]
        return float(values[-1]) if values else 0.0

    return {
        "exit_code": exit_code,
        "steps": trained[-1]["step"] if trained else 0,
        "seconds": seconds,
        "restarts": int(last(FAULTS_ACTOR_RESTARTS)),
        "steps_redone": int(last(FAULTS_STEPS_REDONE)),
        "load": os.getloadavg()[0],
        "output": output,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="demo runs, back to back")
    parser.add_argument("--steps", type=int, default=1000, help="training steps per run")
    parser.add_argument(
        "--load", type=float, default=3.0, help="busy processes per CPU (0: a quiet machine)"
    )
    parser.add_argument(
        "--nice", type=int, default=15, help="niceness of the busy processes (Ray actors: 15)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout-min", type=float, default=60.0, help="a run still going after this failed"
    )
    parser.add_argument("--out", type=Path, default=None, help="run folders go here (kept)")
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="grpo-load-"))
    hogs = start_load(round(args.load * (os.cpu_count() or 1)), args.nice)
    print(f"{len(hogs)} busy processes at nice {args.nice}; runs in {out}")
    print(f"load at start: {load_average()}")
    rows, failures = [], 0
    try:
        for index in range(args.runs):
            result = one_run(out / f"run_{index}", args.steps, args.seed, args.timeout_min * 60)
            finished = result["exit_code"] == 0 and result["steps"] == args.steps
            failures += not finished
            row = [
                f"run {index}",
                "yes" if finished else "NO",
                result["exit_code"],
                f"{result['steps']}/{args.steps}",
                f"{result['seconds']:.0f}",
                result["restarts"],
                result["steps_redone"],
                f"{result['load']:.1f}",
            ]
            rows.append(row)
            print("  ".join(str(cell) for cell in row), flush=True)
            if not finished:
                print("  last lines of its output:")
                for line in result["output"].strip().splitlines()[-15:]:
                    print(f"    {line}")
    finally:
        for hog in hogs:
            hog.kill()
    header = ["run", "finished", "exit", "steps", "seconds", "restarts", "redone", "load 1m"]
    print_table(f"{args.runs} demo runs at {args.load:g}x load", header, rows)
    print(f"\nfinished {args.runs - failures} of {args.runs}; load at end: {load_average()}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
