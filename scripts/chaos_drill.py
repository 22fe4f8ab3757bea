"""Chaos drill: the demo run while actors and whole nodes are killed at random, against the
same run left alone.

Two runs of ``grpo run async_grpo --config tiny_arithmetic_cpu`` with the same seed, one
after the other: an undisturbed one, then one during which every ``--every`` seconds
(after its first training step) a random victim is killed with SIGKILL, as a crash or the
out-of-memory killer would: a collector, the reference actor, the replay buffer, the trainer,
or with ``--cluster`` (the default) a whole node of a simulated Ray cluster
(`ray.cluster_utils.Cluster`: a head node, two generation nodes, two learner nodes; the node
of a random actor is removed without a graceful shutdown, and a fresh node with the same
resources is added, as an autoscaler would). Kills stop ``--quiet-steps`` before the end:
the run's finishing stage (final checkpoint, final weights) is not covered by the restarts.

It prints each kill as it happens, then:

- kills, and kills survived (the run went on and finished every step);
- restarts (`faults/actor_restarts`) and steps redone after trainer restarts
  (`faults/steps_redone`: steps trained again from the latest checkpoint);
- groups lost: sequence ids are ``w0-0, w0-1, ...`` in generation order, so a gap among the
  scored ids is a group generated and never scored;
- trajectories trained twice outside the documented redo: duplicates among the trained
  sequence ids once the rewound steps are left out (`records_after_rewinds`);
- final held-out greedy accuracy of both runs (512 test questions: about +-2 points of
  evaluation noise) and their wall time.

Usage:
    python scripts/chaos_drill.py                      # 20 kills, demo seed 0, simulated cluster
    python scripts/chaos_drill.py --kills 6 --steps 300 --no-cluster
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from grpo.config import repo_root
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    FAULTS_ACTOR_RESTARTS,
    FAULTS_STEPS_REDONE,
)
from grpo.observability.metrics import records_after_rewinds
from grpo.testing import read_jsonl

# The actor classes a kill picks from, by the name the run gives their actors.
ACTORS = {
    "inference": "SyncLLMCollector",
    "ref": "RefActor",
    "replay_buffer": "ReplayBufferActor",
    "training": "PyTorchActorModel",
}
ROLLOUT_NODE = {"num_cpus": 1, "resources": {"rollout_node": 1}}
LEARNER_NODE = {"num_cpus": 2, "resources": {"learner_node": 2}}
PLACEMENT = (
    "inference.resources={rollout_node: 1}",
    "ref.resources={learner_node: 1}",
    "training.resources={learner_node: 1}",
)


def actor_processes(class_name: str) -> list[psutil.Process]:
    """This drill's Ray worker processes running an actor of ``class_name``.

    Ray titles an actor's process ``ray::<Class>`` (``ray::<Class>.<method>`` while it
    runs a call); every Ray process of the drill descends from this one.
    """
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::{class_name}"):
            found.append(process)
    return found


def trained_steps(run_dir: Path) -> int:
    """The step the run has reached, from its ledger (a rewind goes back)."""
    path = run_dir / "trained.jsonl"
    if not path.is_file():
        return 0
    records = read_jsonl(path)
    standing = records_after_rewinds(records)
    return standing[-1]["step"] if standing else 0


class SimulatedCluster:
    """A Ray cluster of several nodes on this machine; nodes are removed and replaced."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        self.kinds: dict[Any, dict[str, Any]] = {}
        for kind in (ROLLOUT_NODE, ROLLOUT_NODE, LEARNER_NODE, LEARNER_NODE):
            self.add(kind)
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, kind: dict[str, Any]) -> None:
        self.kinds[self.cluster.add_node(**kind)] = kind

    def node_of(self, process: psutil.Process) -> Any:
        """The worker node whose raylet ``process`` descends from (None: the head's)."""
        from ray._private import ray_constants

        ancestors = {parent.pid for parent in process.parents()}
        for node in self.kinds:
            raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
            if raylet.pid in ancestors:
                return node
        return None

    def replace(self, node: Any) -> None:
        """Remove ``node`` at once (its raylet and every process on it), add a fresh one."""
        kind = self.kinds.pop(node)
        self.cluster.remove_node(node, allow_graceful=False)
        self.add(kind)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def run_demo(run_dir: Path, args: argparse.Namespace, cluster: SimulatedCluster | None) -> dict:
    """Start the demo run in a subprocess; returns it and the time it started."""
    command = [
        *(sys.executable, "-m", "grpo", "run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
        f"output_dir={run_dir}",
        f"seed={args.seed}",
        f"orchestration.num_steps={args.steps}",
        f"orchestration.max_actor_restarts={args.kills}",
        f"checkpoint.save_every_n_steps={args.checkpoint_every}",
    ]
    if cluster is not None:
        command += [f"ray.address={cluster.address}", *PLACEMENT]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return {
        "process": subprocess.Popen(
            command, env=env, cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ),
        "started": time.monotonic(),
    }


def chaos(
    run_dir: Path,
    process: subprocess.Popen,
    args: argparse.Namespace,
    cluster: SimulatedCluster | None,
    kills: list[dict],
) -> None:
    """Kill a random victim every ``args.every`` seconds until ``args.kills`` are done."""
    rng = random.Random(args.seed)
    kinds = [*ACTORS, "node"] if cluster is not None else list(ACTORS)
    while process.poll() is None and trained_steps(run_dir) < 1:
        time.sleep(0.5)
    while process.poll() is None and len(kills) < args.kills:
        time.sleep(args.every)
        step = trained_steps(run_dir)
        if process.poll() is not None or step >= args.steps - args.quiet_steps:
            return
        kind = rng.choice(kinds)
        role = rng.choice(list(ACTORS)) if kind == "node" else kind
        victims = actor_processes(ACTORS[role])
        if not victims:
            continue  # being replaced right now: draw again at the next tick
        victim = rng.choice(victims)
        if kind == "node":
            node = cluster.node_of(victim)
            if node is None:
                kind = role  # its actor lives on the head node (the driver's): kill it alone
            else:
                what = f"node of {role} ({node.node_id[:8]})"
                cluster.replace(node)
        if kind != "node":
            what = role
            victim.send_signal(signal.SIGKILL)
        kills.append({"step": step, "victim": what, "at": time.monotonic()})
        print(f"  kill {len(kills):2d} at step {step:4d}: {what}", flush=True)


def summarise(run_dir: Path, process: subprocess.Popen, started: float) -> dict:
    """What a finished run's files say."""
    output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    process.wait()
    metrics = read_jsonl(run_dir / "metrics.jsonl")

    def last(key: str, default: float = 0.0) -> float:
        values = [r[key] for r in metrics if key in r]
        return values[-1] if values else default

    scored = [
        sid
        for r in read_jsonl(run_dir / "scored.jsonl")
        if "sequence_ids" in r
        for sid in r["sequence_ids"]
    ]
    lost = 0
    by_worker: dict[str, set[int]] = {}
    for sid in scored:
        worker, number = sid.rsplit("-", 1)
        by_worker.setdefault(worker, set()).add(int(number))
    for numbers in by_worker.values():
        lost += max(numbers) + 1 - len(numbers)
    trained = [
        sid
        for r in records_after_rewinds(read_jsonl(run_dir / "trained.jsonl"))
        for sid in r["sequence_ids"]
    ]
    return {
        "exit": process.returncode,
        "output_tail": output[-2000:],
        "seconds": time.monotonic() - started,
        "steps": trained_steps(run_dir),
        "restarts": int(last(FAULTS_ACTOR_RESTARTS)),
        "steps_redone": int(last(FAULTS_STEPS_REDONE)),
        "sequences_lost": lost,
        "trained_twice": len(trained) - len(set(trained)),
        "accuracy": last(EVAL_ACCURACY, float("nan")),
        "checkpoint_s": last("checkpoint/time (s)", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--steps", type=int, default=1000, help="the demo's 1000 by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    parser.add_argument("--quiet-steps", type=int, default=20, help="no kills this near the end")
    parser.add_argument("--cluster", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--skip-undisturbed", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep both runs' folders here")
    args = parser.parse_args()

    base = args.keep or Path(tempfile.mkdtemp(prefix="chaos_drill_"))
    results: dict[str, dict] = {}
    kills: list[dict] = []
    for name in ("undisturbed", "chaos"):
        if name == "undisturbed" and args.skip_undisturbed:
            continue
        cluster = SimulatedCluster() if args.cluster else None
        run_dir = base / name
        print(f"{name} run: {run_dir}", flush=True)
        try:
            started = run_demo(run_dir, args, cluster)
            if name == "chaos":
                chaos(run_dir, started["process"], args, cluster, kills)
            results[name] = summarise(run_dir, started["process"], started["started"])
        finally:
            if cluster is not None:
                cluster.shutdown()
        if results[name]["exit"] != 0:
            print(results[name]["output_tail"], file=sys.stderr)

    chaos_run = results["chaos"]
    # A run that stopped was stopped by its last kill; the ones before it were survived.
    survived = len(kills) if chaos_run["exit"] == 0 else max(len(kills) - 1, 0)
    by_kind: dict[str, int] = {}
    for kill in kills:
        kind = "node" if kill["victim"].startswith("node") else kill["victim"]
        by_kind[kind] = by_kind.get(kind, 0) + 1
    print()
    print(f"kills: {len(kills)} ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))})")
    print(f"kills survived: {survived} of {len(kills)} (exit code {chaos_run['exit']})")
    print(f"actor restarts: {chaos_run['restarts']}; steps redone: {chaos_run['steps_redone']}")
    print(f"groups lost: {chaos_run['sequences_lost']} sequences")
    print(f"trajectories trained twice outside the redo: {chaos_run['trained_twice']}")
    print()
    print("| run | steps | final held-out accuracy | wall |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['steps']} | {100 * r['accuracy']:.1f}% | {r['seconds'] / 60:.1f} min |"
        )
    if "undisturbed" in results:
        gap = 100 * (chaos_run["accuracy"] - results["undisturbed"]["accuracy"])
        print(f"accuracy, chaos - undisturbed: {gap:+.1f} points (evaluation noise about 2)")
    print(json.dumps({"kills": kills, "results": results}, default=str), file=sys.stderr)


if __name__ == "__main__":
    main()
