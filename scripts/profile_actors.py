"""Where each actor of a run spends its time: py-spy samples every Ray actor of a live run.

Starts ``grpo run async_grpo --config CONFIG`` (default: the benchmark's demo workload,
`bench_vs_trl.DEMO_OVERRIDES`, no evaluation) in a child process, waits until its actors
have started and the run has trained a few steps, then records each actor process (collector,
reference actor, trainer, replay buffer) and the driver with ``py-spy record`` for the same
window, stops the run, and prints per process:

* the frames most often on top of the stack (self time: where the CPU actually is), and
* the functions of this package most often anywhere on the stack (inclusive time).

Percentages are of that process's samples; a process that waits (on a queue, a lock, Ray)
shows its waiting frame. ``--idle`` keeps idle frames (``epoll_wait``, ``sleep``, ...) in.

Before py-spy starts (its sampling costs CPU too), a ``--cpu-seconds`` window counts the CPU
time of every process from ``/proc`` and the steps trained in it, and prints core-milliseconds
per step: busy and idle for the whole machine, and for the busiest processes (the actors and
the driver by role; reward pools, the metric logger, W&B and Ray by command line). On a small
machine this says whether a step is bound by one process or by the cores all of them share.

py-spy is installed with Ray. Usage:
    python scripts/profile_actors.py                       # 40 s window after 60 s
    python scripts/profile_actors.py --seconds 60 -- inference.max_generated_tokens=64
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_vs_trl import CONFIG, DEMO_OVERRIDES

# Ray names an actor's process after its class; the driver runs the recipe.
ROLES = {
    "inference": "ray::SyncLLMCollector",
    "ref": "ray::RefActor",
    "training": "ray::PyTorchActorModel",
    "replay_buffer": "ray::ReplayBuffer",
}
# Frames where a thread only waits: left out of the self-time table unless --idle.
IDLE_FRAMES = ("epoll_wait", "select", "poll", "sleep", "wait", "_wait_for_tstate_lock", "get")


def actor_pids() -> dict[str, list[int]]:
    """Process ids of the run's actors by role, from their process titles."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, list[int]] = collections.defaultdict(list)
    for line in listing.splitlines():
        pid, _, command = line.strip().partition(" ")
        for role, title in ROLES.items():
            if command.startswith(title):
                found[role].append(int(pid))
    return found


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``state`` first), or None once
    the process has exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it has exited)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def machine_cpu_seconds() -> tuple[float, float]:
    """Busy and idle CPU seconds of the whole machine so far, all cores (``/proc/stat``)."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), idle / os.sysconf("SC_CLK_TCK")


def trained_steps(metrics: Path) -> int:
    """Rows of the run's metrics.jsonl that a training step logged."""
    if not metrics.exists():
        return 0
    return sum('"training/loss"' in line for line in metrics.read_text().splitlines())


def process_names() -> dict[int, str]:
    """Every process's pid and its command line (Ray's title for a worker: ``ray::Class``)."""
    names = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:  # gone meanwhile
                continue
            names[int(entry.name)] = command
    return names


def cpu_per_step(targets: dict[str, list[int]], metrics: Path, seconds: float, top: int) -> None:
    """Print core-milliseconds per trained step over ``seconds``: the machine's, and those of
    the ``top`` busiest processes (the roles in ``targets`` by name; reward pools, the metric
    logger, W&B and Ray's own processes by command line)."""
    roles = {pid: role for role, ids in targets.items() for pid in ids}
    before = {pid: cpu_seconds(pid) for pid in process_names()}
    machine_before, steps_before, start = machine_cpu_seconds(), trained_steps(metrics), time.time()
    time.sleep(seconds)
    names = process_names()
    used = {pid: cpu_seconds(pid) - before.get(pid, 0.0) for pid in names}
    machine_after, steps = machine_cpu_seconds(), trained_steps(metrics) - steps_before
    if steps < 1:
        print(f"no step trained in the {seconds:.0f} s CPU window")
        return
    wall = time.time() - start
    busy, idle = (1e3 * (a - b) / steps for a, b in zip(machine_after, machine_before))
    print(
        f"CPU per step over {wall:.0f} s, {steps} steps ({1e3 * wall / steps:.1f} ms a step, "
        f"{os.cpu_count()} cores): machine busy {busy:.1f} core-ms, idle {idle:.1f}; the "
        f"{top} busiest processes:"
    )
    for pid in sorted(used, key=used.get, reverse=True)[:top]:
        print(f"  {1e3 * used[pid] / steps:7.1f} core-ms  {process_label(pid, roles, names)}")


def parent_pid(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def process_label(pid: int, roles: dict[int, str], names: dict[int, str]) -> str:
    """A role, or a command line and the role whose process started it (a reward pool's
    workers descend from the actor that scores)."""
    if pid in roles:
        return f"{roles[pid]} (pid {pid})"
    label = f"{names.get(pid, '')[:50] or '?'} (pid {pid})"
    if label.startswith("ray::"):  # an actor or Ray's own: raylet started it
        return label
    ancestor = parent_pid(pid)
    for _ in range(3):  # a pool's workers are its forkserver's children
        if ancestor is None or ancestor in roles:
            break
        ancestor = parent_pid(ancestor)
    return f"{label}, started by {roles[ancestor]}" if ancestor in roles else label


def record(pid: int, seconds: float, out: Path, py_spy: str) -> subprocess.Popen:
    """Start ``py-spy record`` of ``pid`` (all threads, native frames off) in raw format."""
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds))]
    command += ["--rate", "50", "--format", "raw", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize(raw: Path, top: int, keep_idle: bool) -> tuple[int, list, list]:
    """Self-time and in-package inclusive-time tables of one raw py-spy profile.

    Returns:
        tuple: Total samples, ``[(share, frame)]`` by self time, ``[(share, frame)]`` of
        ``grpo/`` functions by inclusive time.
    """
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        name = frames[-1]
        if keep_idle or not name.split(" ")[0].endswith(IDLE_FRAMES):
            leaf[name] += count
        for frame in set(frames):
            if "grpo/" in frame or "recipes/" in frame:
                inclusive[frame] += count

    def shares(counter):
        return [(count / max(total, 1), frame) for frame, count in counter.most_common(top)]

    return total, shares(leaf), shares(inclusive)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="recording window")
    parser.add_argument("--delay", type=float, default=60.0, help="seconds before recording")
    parser.add_argument(
        "--cpu-seconds", type=float, default=20.0, help="CPU-per-step window before recording"
    )
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    parser.add_argument("--idle", action="store_true", help="keep waiting frames")
    parser.add_argument("--keep", type=Path, default=None, help="keep the raw profiles here")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    work = Path(args.keep or tempfile.mkdtemp(prefix="profile_actors_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = [
        *DEMO_OVERRIDES,
        f"output_dir={work / 'run'}",
        "orchestration.num_steps=100000",
        "eval_every_n_steps=null",
        *args.overrides,
    ]
    command = [sys.executable, "-m", "grpo.cli", "run", "async_grpo", "--config", CONFIG]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    with open(work / "run.log", "w") as log:
        run = subprocess.Popen(
            [*command, *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        time.sleep(args.delay)
        pids = actor_pids()
        if run.poll() is not None or not pids:
            sys.exit(f"the run is not running (exit {run.poll()}); see {work / 'run.log'}")
        targets = {"driver": [run.pid], **pids}
        cpu_per_step(targets, work / "run" / "metrics.jsonl", args.cpu_seconds, args.top)
        print(
            f"recording {args.seconds:.0f} s of: "
            + ", ".join(f"{role} {pid}" for role, ids in targets.items() for pid in ids),
            flush=True,
        )
        recorders = {
            (role, pid): record(pid, args.seconds, work / f"{role}-{pid}.txt", py_spy)
            for role, ids in targets.items()
            for pid in ids
        }
        for (role, pid), recorder in recorders.items():
            _, stderr = recorder.communicate(timeout=args.seconds + 60)
            if recorder.returncode != 0:
                print(f"py-spy failed on {role} {pid}: {stderr.decode().strip()[-300:]}")
    finally:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
    for role, pid in recorders:
        raw = work / f"{role}-{pid}.txt"
        if not raw.exists():
            continue
        total, self_time, inclusive = summarize(raw, args.top, args.idle)
        print(f"\n== {role} (pid {pid}): {total} samples at 50 Hz, all threads")
        print("  self time (top of stack):")
        for share, frame in self_time:
            print(f"    {100 * share:5.1f}%  {frame[:150]}")
        print("  in this package, inclusive:")
        for share, frame in inclusive:
            print(f"    {100 * share:5.1f}%  {frame[:150]}")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
