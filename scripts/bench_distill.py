"""On-policy distillation against GRPO alone: held-out accuracy after the same number of steps.

Runs two configs from the same starting model, one after the other (each alone on the
machine), for ``--steps`` optimizer steps with held-out evaluation every ``--eval-every``:

* ``tiny_arithmetic_cpu``: GRPO from rewards (the arithmetic demo, dynamic sampling on);
* ``tiny_arithmetic_distill_cpu``: the same student and settings with a teacher
  (``assets/tiny_arithmetic_teacher_qwen2``) whose per-token signal is added to the GRPO
  advantage; ``--distill-override KEY=VALUE`` changes its settings (the signal alone:
  ``ref.distillation_only=true`` with ``ref.filter_zero_variance_groups=false``).

Each run goes through `grpo.cli.main` in a child process (``WANDB_MODE=disabled``, a
temporary ``output_dir``; its output in ``<out>/<name>.log``), and its ``metrics.jsonl`` gives
the held-out greedy accuracy (``eval/accuracy``, 512 test-split questions: about +-2 points of
noise) at every evaluation, and the mean reverse KL to the teacher of the steps since the last
one (``ref_distillation/teacher_reverse_kl``). Printed: both curves side by side, each
run's gain and wall time (start-up and evaluations included), and the ratio of the gains.
``--teacher`` also evaluates the teacher itself (``grpo eval``), the ceiling of distillation.

Usage:
    python scripts/bench_distill.py                      # 500 steps each, about 9 min on 2 cores
    python scripts/bench_distill.py --steps 1000 --eval-every 100 --teacher
    python scripts/bench_distill.py --distill-override ref.distillation_only=true \
        --distill-override ref.filter_zero_variance_groups=false
    python scripts/bench_distill.py --only distill --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import load_average, print_table, run_child

from grpo.observability.metric_names import EVAL_ACCURACY, REF_TEACHER_REVERSE_KL

RUNS = {"grpo": "tiny_arithmetic_cpu", "distill": "tiny_arithmetic_distill_cpu"}
TEACHER = "assets/tiny_arithmetic_teacher_qwen2"
CLI = "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps of each run")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", choices=sorted(RUNS), default=None, help="run one of the two configs"
    )
    parser.add_argument(
        "--distill-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of the distillation run only (repeatable)",
    )
    parser.add_argument("--teacher", action="store_true", help="also evaluate the teacher")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: temporary)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit of each run")
    return parser.parse_args()


def run(command: list[str], log_path: Path, timeout_s: float) -> float:
    """Run ``grpo COMMAND...`` with output to ``log_path`` and W&B off; return its wall seconds."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return run_child([sys.executable, "-c", CLI, *command], log_path, timeout_s, env)


def train(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One training run; its accuracy and reverse-KL curves and its wall time."""
    run_dir = out / name
    overrides = [
        f"output_dir={run_dir}",
        "overwrite_output_dir=true",
        f"seed={args.seed}",
        f"orchestration.num_steps={args.steps}",
        f"eval_every_n_steps={args.eval_every}",
        *(args.distill_override if name == "distill" else []),
    ]
    command = ["run", "async_grpo", "--config", RUNS[name], *overrides]
    print(f"{name}: grpo {' '.join(command)}", flush=True)
    seconds = run(command, out / f"{name}.log", args.timeout_s)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row[EVAL_ACCURACY] for row in rows if EVAL_ACCURACY in row}
    kls = [
        (row["time"], row[REF_TEACHER_REVERSE_KL]) for row in rows if REF_TEACHER_REVERSE_KL in row
    ]
    eval_times = {row["step"]: row["time"] for row in rows if EVAL_ACCURACY in row}
    # The reverse KL of the batches scored between two evaluations, by the later one's step.
    reverse_kl, previous = {}, -float("inf")
    for step in sorted(eval_times):
        window = [kl for at, kl in kls if previous < at <= eval_times[step]]
        if window:
            reverse_kl[step] = sum(window) / len(window)
        previous = eval_times[step]
    print(f"{name}: {seconds:.0f} s, held-out accuracy {_curve(accuracy)}", flush=True)
    return {"accuracy": accuracy, "reverse_kl": reverse_kl, "seconds": seconds}


def _curve(accuracy: dict[int, float]) -> str:
    return ", ".join(f"{100 * value:.1f}% @ {step}" for step, value in sorted(accuracy.items()))


def _gain(result: dict[str, Any]) -> float:
    accuracy = result["accuracy"]
    return 100 * (accuracy[max(accuracy)] - accuracy[min(accuracy)])


def main() -> int:
    args = parse_args()
    print(f"load average at the start: {load_average()}")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_distill_"))
    out.mkdir(parents=True, exist_ok=True)
    names = [args.only] if args.only else list(RUNS)
    results = {name: train(name, args, out) for name in names}

    steps = sorted(set().union(*(result["accuracy"] for result in results.values())))
    header = ["step", *(f"{name} accuracy" for name in names)]
    if "distill" in results:
        header.append("distill reverse KL")
    rows = []
    for step in steps:
        row: list[Any] = [step]
        for name in names:
            value = results[name]["accuracy"].get(step)
            row.append("-" if value is None else f"{100 * value:.1f}%")
        if "distill" in results:
            kl = results["distill"]["reverse_kl"].get(step)
            row.append("-" if kl is None else f"{kl:.3f}")
        rows.append(row)
    print_table(
        f"Held-out greedy accuracy, {args.steps} steps, seed {args.seed} (out: {out})", header, rows
    )
    print()
    for name in names:
        result = results[name]
        print(
            f"{name:8s} {RUNS[name]}: {_gain(result):+.1f} points in {args.steps} steps, "
            f"{result['seconds'] / 60:.1f} min wall"
        )
    if len(results) == 2 and _gain(results["grpo"]) > 0:
        ratio = _gain(results["distill"]) / _gain(results["grpo"])
        print(f"gain of distill / gain of grpo: {ratio:.2f}")
    if args.teacher:
        eval_dir = out / "teacher_eval"
        overrides = [f"base_model_path={TEACHER}", f"output_dir={eval_dir}"]
        run(["eval", RUNS["grpo"], *overrides], out / "teacher_eval.log", args.timeout_s)
        report = json.loads((eval_dir / "eval.json").read_text())
        print(f"teacher {TEACHER}: held-out accuracy {100 * report['metrics'][EVAL_ACCURACY]:.1f}%")
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
