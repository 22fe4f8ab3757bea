"""Kill each kind of actor in the middle of a real tiny run and report what happened.

For every victim (a collector, the reference actor, the replay buffer, the rollout queue, a
trainer) the script starts the tiny async pipeline (Ray, vLLM CPU, torchtune, math-verify;
checkpoints every 2 steps), lets it train ``--kill-at`` steps, ``ray.kill``s the victim, and
lets the run go on to ``--steps``. It prints one row per fault:

- outcome: ``replaced`` (the run finished every step) or ``stopped: <error>``;
- seconds: for a replacement, from the moment the driver noticed the death to the first call
  the replacement finished (its start-up included; `Recovery.seconds_to_work`); for a stop,
  from the kill to the error;
- groups lost: sequence ids are ``w0-0, w0-1, ...`` in generation order, so a gap among the
  scored ids is a group that was generated and never scored;
- trained twice: sequence ids that appear in more than one training step;
- steps lost: trained steps not in the latest checkpoint, for a run that stopped (what a
  resume would have to redo).

Usage:
    python scripts/fault_drill.py                 # 12 steps, kill after step 4
    python scripts/fault_drill.py --steps 20 --kill-at 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray

from grpo.config import repo_root
from grpo.orchestrator import ActorFailedError
from grpo.testing import kill_at_steps, start_tiny_run

VICTIMS = ["inference[0]", "ref[0]", "replay_buffer", "rollout_queue", "training[0]"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drill(victim: str, model_dir: Path, run_dir: Path, steps: int, kill_at: int) -> dict:
    """One run with one fault; returns the row to print."""
    run = start_tiny_run(
        model_dir,
        run_dir,
        steps,
        "orchestration.stall_timeout_s=120",
        "checkpoint.save_every_n_steps=2",
        "metric_logger.mode=disabled",
    )
    killed_at = kill_at_steps(run, [(kill_at, victim)])
    try:
        run.run()
        outcome = f"replaced, finished {run.state.step} steps"
        seconds = sum(r.seconds_to_work or float("nan") for r in run.recoveries)
    except ActorFailedError as error:
        outcome = f"stopped at step {run.state.step}: {str(error).split(' (')[0]}"
        seconds = time.monotonic() - killed_at[victim]
    finally:
        run.shutdown()
        ray.shutdown()

    scored = [sid for r in read_jsonl(run_dir / "scored.jsonl") for sid in r["sequence_ids"]]
    numbers = {int(sid.split("-")[1]) for sid in scored}
    trained = [sid for r in read_jsonl(run_dir / "trained.jsonl") for sid in r["sequence_ids"]]
    latest = run_dir / "checkpoints" / "latest"
    checkpoint_step = (
        json.loads((run_dir / "checkpoints" / latest.read_text() / "state.json").read_text())[
            "step"
        ]
        if latest.is_file()
        else 0
    )
    return {
        "fault": f"ray.kill({victim}) after step {kill_at}",
        "outcome": outcome,
        "seconds": seconds,
        "groups lost": (max(numbers) + 1 - len(numbers)) // run.cfg.inference.group_size,
        "trained twice": len(trained) - len(set(trained)),
        "steps lost": run.state.step - checkpoint_step if run.state.step < steps else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument(
        "--model-dir", type=Path, default=repo_root() / "assets/tiny_arithmetic_qwen2"
    )
    parser.add_argument("--victims", nargs="+", default=VICTIMS, choices=VICTIMS)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fault_drill_") as tmp:
        for victim in args.victims:
            rows.append(drill(victim, args.model_dir, Path(tmp) / victim, args.steps, args.kill_at))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    columns = ["fault", "outcome", "seconds", "groups lost", "trained twice", "steps lost"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.1f}" if c == "seconds" else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
