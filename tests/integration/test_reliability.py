"""Checkpoint and exact resume, killed actors, and graceful stops on SIGINT / SIGTERM.

Starting a run (Ray, a vLLM engine, reference and trainer) takes tens of seconds on two
cores, and a step of these tiny runs well under one, so the tests share runs where one shows
several properties: one undisturbed deterministic run (the `undisturbed` fixture) is what the
resumed and the restarted runs must reproduce, the resumed run goes on until Ctrl-C stops it,
the run that SIGTERM stops extends a copy of the undisturbed one under another lr, and the
run stopped by its diverged losses has two actors die before a checkpoint after it.
"""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file

from grpo.cli import main as grpo_main
from grpo.observability.metric_names import (
    FAULTS_ACTOR_RESTARTS,
    FAULTS_STEPS_REDONE,
    TRAIN_LOSS,
    TRAIN_LR,
)
from grpo.observability.metrics import records_after_rewinds
from grpo.observability.plotting import read_metrics
from grpo.orchestrator import ActorFailedError, Orchestrator, TrainingDivergedError
from grpo.orchestrator.state import CallKind
from grpo.testing import (
    RANDOM_MODEL_OVERRIDES,
    gathered_training_state,
    kill_at_steps,
    read_jsonl,
    start_tiny_run,
)
from tests.helpers.training_state import assert_same_training_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r[TRAIN_LOSS] for r in read_jsonl(run_dir / "metrics.jsonl") if TRAIN_LOSS in r
    }


def trained_ids(run_dir: Path) -> list[str]:
    return [sid for r in read_jsonl(run_dir / "trained.jsonl") for sid in r["sequence_ids"]]


def trained_versions(run_dir: Path) -> list[list[int]]:
    """The policy versions of each standing step's trajectories."""
    return [
        r["policy_versions"] for r in records_after_rewinds(read_jsonl(run_dir / "trained.jsonl"))
    ]


# The settings of the runs that must reproduce one another exactly (resume, trainer restart).
DETERMINISTIC = (
    *RANDOM_MODEL_OVERRIDES,
    "orchestration.synchronous=true",
    # Nothing older than the current weights is trained: a resumed or restarted run whose
    # collectors labelled their samples with an older version than their weights would
    # drop every sample and never fill a batch.
    "orchestration.max_policy_lag=0",
    "training.lr_scheduler=null",
    "checkpoint.save_every_n_steps=2",
    "eval_every_n_steps=null",
    "inference.max_generated_tokens=12",
    "inference.batch_size=4",
    "training.batch_size=32",
    # A reward the random tiny model earns sometimes, so losses and updates are non-zero.
    "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
    "ref.reward_weights=null",
)


def deterministic_overrides(model_dir: Path, run_dir: Path, num_steps: int) -> list[str]:
    return [
        f"base_model_path={model_dir}",
        f"output_dir={run_dir}",
        f"orchestration.num_steps={num_steps}",
        *DETERMINISTIC,
    ]


def training_state(run: Orchestrator) -> dict:
    """Trainer rank 0's whole model and optimizer state, gathered in its process."""
    return ray.get(run.trainers[0].__ray_call__.remote(gathered_training_state))


@dataclass(frozen=True)
class Undisturbed:
    """A finished deterministic run: its folder (read-only) and trainer rank 0's whole state
    after each step."""

    run_dir: Path
    states_at: dict[int, dict]


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir, tmp_path_factory) -> Undisturbed:
    """The deterministic 4-step run, one trainer, checkpoints at steps 2 and 4, that the
    resumed and the restarted runs must reproduce (and that SIGTERM's run extends a copy of).

    Four steps: a checkpoint (step 2) to go on from and, after it, a step a restarted run
    loses when its trainer dies (step 3) and one it trains after redoing it (step 4)."""
    run_dir = tmp_path_factory.mktemp("undisturbed") / "run"
    states_at: dict[int, dict] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        run = start_tiny_run(tiny_model_dir, run_dir, 4, *DETERMINISTIC)
        try:
            run.run(on_step=lambda state: states_at.setdefault(state.step, training_state(run)))
            run.save_final_checkpoint()
        finally:
            run.shutdown()
            ray.shutdown()
    return Undisturbed(run_dir, states_at)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes: list[psutil.Process], within_s: float = 30.0) -> None:
    """Every one of ``processes`` ends within ``within_s`` (a zombie counts as ended)."""

    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if running(p)]
    assert not alive, f"orphan processes: {[(p.pid, p.name()) for p in alive]}"


def ctrl_c_once_trained(trained: Path, records: int, finished: threading.Event) -> dict[str, Any]:
    """In a background thread, send this process SIGINT, as Ctrl-C does, once ``trained``
    holds ``records`` records, unless ``finished`` is set first (a Ctrl-C after the run would
    interrupt pytest itself).

    Returns:
        dict[str, Any]: Filled as it is sent: ``at`` (``time.monotonic()``) and ``children``
        (the processes started since this call and alive then: the run's).
    """
    before = {p.pid for p in descendants(os.getpid())}
    sent: dict[str, Any] = {}

    def wait_and_send() -> None:
        deadline = time.monotonic() + 300
        while not finished.is_set() and time.monotonic() < deadline:
            if trained.exists() and trained.read_text().count("\n") >= records:
                sent["children"] = [p for p in descendants(os.getpid()) if p.pid not in before]
                sent["at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.5)

    threading.Thread(target=wait_and_send, daemon=True).start()
    return sent


def grpo_run(
    model_dir: Path, run_dir: Path, num_steps: int, *more: str, workers: int = 1, keep_ray=False
) -> int:
    """``grpo run`` of a deterministic run in this process; Ray is shut down after it, unless
    ``keep_ray`` (the next run of the same test joins it: one start-up less)."""
    try:
        return grpo_main(
            [
                *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
                *deterministic_overrides(model_dir, run_dir, num_steps),
                f"orchestration.num_training_workers={workers}",
                f"ray.num_cpus={3 + workers}",
                *more,
            ]
        )
    finally:
        if not keep_ray:
            ray.shutdown()


def weights_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy weights of a run's checkpoint of ``step``."""
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def assert_continues_exactly(straight: Path, resumed: Path, model_dir: Path) -> None:
    """``resumed``, resumed from step 2's checkpoint of the finished 4-step run ``straight``,
    trained its steps 3 and 4 exactly as ``straight`` did."""
    # The same prompts and samples, in the same order: nothing trained twice or skipped; and
    # the same policy versions (the resumed collectors label what they sample with the
    # checkpoint's version, the version of the weights they start from).
    straight_records = read_jsonl(straight / "trained.jsonl")
    assert [r["step"] for r in straight_records] == [1, 2, 3, 4]
    continued = straight_records[2:]
    resumed_records = read_jsonl(resumed / "trained.jsonl")[:2]
    assert [r["step"] for r in resumed_records] == [3, 4]
    assert [r["sequence_ids"] for r in resumed_records] == [r["sequence_ids"] for r in continued]
    assert trained_versions(resumed)[:2] == [r["policy_versions"] for r in continued]
    assert len(set(trained_ids(straight))) == len(trained_ids(straight))
    # Same per-step losses. Both runs execute the same fp32 CPU kernels on the same data in
    # the same order, so they agree to rounding; 1e-6 relative leaves room for nothing else.
    straight_losses, resumed_losses = losses(straight), losses(resumed)
    assert sorted(straight_losses) == [1, 2, 3, 4] and sorted(resumed_losses)[:2] == [3, 4]
    for step in (3, 4):
        assert resumed_losses[step] == pytest.approx(straight_losses[step], rel=1e-6, abs=1e-9)
    assert any(abs(straight_losses[step]) > 0 for step in (3, 4)), "no learning signal to compare"
    # Same weights after step 4 (AdamW moments and step counts were restored, not rebuilt),
    # which steps 3 and 4 moved away from the checkpoint's.
    base = load_file(Path(model_dir) / "model.safetensors")
    assert any(not torch.equal(weights_at(straight, 4)[k], base[k]) for k in base)
    assert any(
        not torch.equal(weights_at(straight, 4)[k], weights_at(straight, 2)[k]) for k in base
    )
    for name, tensor in weights_at(straight, 4).items():
        torch.testing.assert_close(weights_at(resumed, 4)[name], tensor, rtol=1e-6, atol=1e-7)


def assert_refused_before_ray_starts(model_dir: Path, run_dir: Path, workers: int, capsys) -> None:
    """Resuming ``run_dir`` with a num_steps that trains nothing, or with another seed, is
    refused before Ray starts: each checkpoint records the config it ran with."""
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    step = json.loads((latest / "state.json").read_text())["step"]
    capsys.readouterr()
    for more, key in (
        ([], "orchestration.num_steps"),
        ([f"orchestration.num_steps={step + 1}", "seed=3"], "seed"),
    ):
        args = deterministic_overrides(model_dir, run_dir, step)
        args += [f"orchestration.num_training_workers={workers}", f"ray.num_cpus={3 + workers}"]
        run = ["run", "async_grpo", "--config", "tiny_arithmetic_cpu"]
        assert grpo_main([*run, *args, "resume_from_checkpoint=true", *more]) == 2
        err = capsys.readouterr().err
        assert f"{key}: " in err and "Traceback" not in err, err
        assert not ray.is_initialized()


def test_resume_continues_exactly(
    undisturbed, tiny_model_dir, tmp_path, monkeypatch, capsys, ray_shared
):
    """A run resumed from step 2's checkpoint of the undisturbed 4-step run trains steps 3
    and 4 exactly as it did: the same prompts, samples and policy versions, losses and
    weights. Ctrl-C (SIGINT) then stops it gracefully: status 130, a checkpoint of the step
    it stopped at, no process left behind.

    Two trainers: `test_resume_with_two_fsdp_trainers_continues_exactly`. SIGTERM, to a run
    in a process of its own: `test_signal_stops_gracefully`."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    resumed = tmp_path / "resumed"
    from_checkpoint = undisturbed.run_dir / "checkpoints" / "step_000002"
    trained = resumed / "trained.jsonl"
    finished = threading.Event()
    # Ctrl-C once steps 3 and 4 are trained; the run stops after the step it is in then.
    sent = ctrl_c_once_trained(trained, 2, finished)
    try:
        status = grpo_run(tiny_model_dir, resumed, 500, f"resume_from_checkpoint={from_checkpoint}")
    except KeyboardInterrupt:  # escaping, it would end the whole test session
        pytest.fail("Ctrl-C escaped grpo run as KeyboardInterrupt")
    finally:
        finished.set()
    stop_seconds = time.monotonic() - sent["at"]
    # 130 for Ctrl-C: a script can tell an interrupted run from a finished one.
    assert status == 130, capsys.readouterr()
    assert stop_seconds < 120
    assert_continues_exactly(undisturbed.run_dir, resumed, tiny_model_dir)

    latest = resumed / "checkpoints" / (resumed / "checkpoints" / "latest").read_text()
    state = json.loads((latest / "state.json").read_text())
    # Every step up to the stop was trained once and is in the checkpoint.
    assert [r["step"] for r in read_jsonl(trained)] == list(range(3, state["step"] + 1))
    assert state["step"] >= 4
    assert (latest / "model" / "model.safetensors").is_file()
    shards = sorted(p.name for p in (latest / "trainer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "extra.pt"]
    # No orphans: every process the run started is gone shortly after it ended.
    assert sent["children"], "the run started no processes"
    assert_all_gone(sent["children"])
    saved = yaml.safe_load((latest / "config.yaml").read_text())
    assert saved["orchestration"]["num_steps"] == 500
    assert_refused_before_ray_starts(tiny_model_dir, resumed, 1, capsys)


def test_resume_with_two_fsdp_trainers_continues_exactly(
    tiny_model_dir, tmp_path, monkeypatch, capsys, ray_shared
):
    """As `test_resume_continues_exactly`, with two trainers: each writes its own shards of
    the model and optimizer state and reads them back (no rank gathers the optimizer state).

    The resumed run saves no periodic checkpoint, so the one it has proves that the end of a
    run saves one and that ``latest`` names the newest."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ray.shutdown()  # two trainers need a cluster with a CPU slot more than one left up has
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert grpo_run(tiny_model_dir, straight, 4, workers=2, keep_ray=True) == 0
    from_checkpoint = straight / "checkpoints" / "step_000002"
    resume = (f"resume_from_checkpoint={from_checkpoint}", "checkpoint.save_every_n_steps=null")
    assert grpo_run(tiny_model_dir, resumed, 4, *resume, workers=2) == 0
    # No periodic checkpoint: the end of the run saved this one.
    checkpoints = resumed / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000004"]
    assert (checkpoints / "latest").read_text() == "step_000004"
    shards = sorted(p.name for p in (checkpoints / "step_000004" / "trainer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]

    assert_continues_exactly(straight, resumed, tiny_model_dir)
    final_straight = load_file(straight / "final" / "model.safetensors")
    final_resumed = load_file(resumed / "final" / "model.safetensors")
    for name, tensor in final_straight.items():
        torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-6, atol=1e-7)
    saved = yaml.safe_load((checkpoints / "step_000004" / "config.yaml").read_text())
    assert saved["orchestration"]["num_steps"] == 4
    assert_refused_before_ray_starts(tiny_model_dir, resumed, 2, capsys)


def start_run(model_dir: Path, run_dir: Path, num_steps: int, *overrides: str) -> Orchestrator:
    return start_tiny_run(
        model_dir,
        run_dir,
        num_steps,
        "orchestration.stall_timeout_s=60",
        "inference.max_generated_tokens=8",
        "inference.batch_size=4",
        "training.batch_size=32",
        *overrides,
    )


def kill_queue_holding_groups(run: Orchestrator, from_step: int) -> list[int]:
    """``ray.kill`` the rollout queue from the loop, right after it handled a generation batch
    at ``from_step`` or later while the queue held groups; returns ``[its size then]``."""
    held: list[int] = []
    on_generated = run._handlers[CallKind.GENERATE]

    def kill_once_it_holds_groups(call, result, relaunch):
        on_generated(call, result, relaunch)
        if not held and run.state.step >= from_step and (size := run.rollout_queue.qsize()):
            held.append(size)
            ray.kill(run.rollout_queue.actor, no_restart=True)

    run._handlers[CallKind.GENERATE] = kill_once_it_holds_groups
    return held


def kill_buffer_holding_groups(run: Orchestrator, from_step: int) -> tuple[set, list[set]]:
    """``ray.kill`` the replay buffer from the loop, right after it yielded a batch at
    ``from_step`` or later and still held groups the next weight sync keeps (older ones the
    loop forgets as stale, dead buffer or not). Then no sample is in flight: one that finished
    before the kill would take groups the buffer held, trained rather than lost.

    Returns:
        tuple: the group ids the buffer held then that the next sync keeps, and ``[the group
        ids the loop found lost]`` once it replaced the buffer (adds read before it noticed
        the death count too).
    """
    held: set = set()
    found_lost: list[set] = []
    on_sampled = run._handlers[CallKind.SAMPLE]
    lost_in_buffer = run.inflight.lost_in_buffer

    def kill_once_it_holds_groups(call, result, relaunch):
        on_sampled(call, result, relaunch)
        if held or run.state.step < from_step:
            return
        # What the loop's `release_stale` keeps after the next sync (one version later).
        oldest_kept = run.state.policy_version + 1 - run.cfg.orchestration.max_policy_lag
        fresh = {
            group_id
            for group_id in run.inflight.in_buffer
            if run.inflight.records[group_id].policy_version >= oldest_kept
        }
        if fresh:
            assert run.scheduler.batch is not None
            assert not run.scheduler.in_flight(CallKind.SAMPLE)
            held.update(fresh)
            ray.kill(run.replay_buffer, no_restart=True)

    def recording_lost_in_buffer():
        lost = lost_in_buffer()
        found_lost.append({record.group_id for record in lost})
        return lost

    run._handlers[CallKind.SAMPLE] = kill_once_it_holds_groups
    run.inflight.lost_in_buffer = recording_lost_in_buffer
    return held, found_lost


def collects_garbage(actor: Any) -> bool:
    """Whether ``actor``'s process collects garbage, with its imports frozen out of the scans."""
    return gc.isenabled() and gc.get_freeze_count() > 0


def test_dead_collector_ref_actor_buffer_and_queue_are_replaced_losing_nothing(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    """Each restartable actor is killed once mid-run (the buffer and the rollout queue while
    they hold groups); the run finishes every step, no generated group is lost, none is
    trained twice, and the replacements compute."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    victims = [(2, "inference[0]"), (5, "ref[0]")]
    # Generation batches of 8 groups, of which a reference call takes 4: the other 4 wait in
    # the queue while the first are scored, so the queue holds groups when it is killed.
    run = start_run(tiny_model_dir, run_dir, 14, "inference.batch_size=8")
    killed = kill_at_steps(run, victims)
    buffer_held, buffer_lost = kill_buffer_holding_groups(run, from_step=8)
    queue_held = kill_queue_holding_groups(run, from_step=10)
    try:
        state = run.run()
        # Every actor's process, the replacements' too, started with garbage collection paused
        # (grpo.workers.gc_pause) and collects again now that its actor is built.
        actors = [
            getattr(actor, "actor", actor)  # the rollout queue's handle is inside it
            for actor in (
                *run.actors.collectors,
                *run.actors.ref_actors,
                *run.actors.trainers,
                run.actors.replay_buffer,
                run.actors.rollout_queue,
                run.actors.metric_logger,
            )
        ]
        collecting = ray.get([a.__ray_call__.remote(collects_garbage) for a in actors])

        def worker_collects_garbage() -> bool:  # local: Ray's workers get it by value
            return gc.isenabled()

        # A process this run's job starts for anything else keeps the pause: Ray's set-up hook.
        paused = not ray.get(ray.remote(num_cpus=0)(worker_collects_garbage).remote())
    finally:
        run.shutdown()
    assert collecting == [True] * 6 and paused
    assert state.step == 14
    assert len(queue_held) == 1 and queue_held[0] > 0
    assert buffer_held and len(buffer_lost) == 1 and buffer_held <= buffer_lost[0]
    # The buffer and the queue die in either order, after the collector and the ref actor.
    names = [name for _, name in victims]
    assert [r.actor for r in run.recoveries[:2]] == names
    assert sorted(r.actor for r in run.recoveries[2:]) == ["replay_buffer", "rollout_queue"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert max(r[FAULTS_ACTOR_RESTARTS] for r in metrics if FAULTS_ACTOR_RESTARTS in r) == 4
    # The groups the dead queue and buffer held were generated again (the ledger checks below
    # find none of them lost).
    assert len([r for r in metrics if "faults/groups_rescued" in r]) == 1
    rescued = [
        r["faults/buffer_groups_rescued"] for r in metrics if "faults/buffer_groups_rescued" in r
    ]
    assert rescued == [len(buffer_lost[0])]
    for recovery in run.recoveries:
        # Noticed at the next call to the actor, and the replacement (a new vLLM engine on
        # CPU for the collector) did its first piece of work within a minute.
        assert recovery.seconds_to_work is not None and recovery.seconds_to_work < 60, recovery

    scored = [sid for r in read_jsonl(run_dir / "scored.jsonl") for sid in r["sequence_ids"]]
    trained = trained_ids(run_dir)
    # Sequence ids are w0-0, w0-1, ... in generation order. Every one up to the newest
    # scored was scored: nothing the dead actors held (queue takes, scored groups, buffer
    # contents) was lost on the way.
    numbers = sorted({int(sid.split("-")[1]) for sid in scored})
    assert numbers == list(range(numbers[-1] + 1))
    # Nothing trained twice, though the replaced collector regenerated groups that had
    # already reached the queue, and the groups of the dead buffer, some of whose
    # trajectories were trained already, were generated and scored again under their ids.
    assert len(set(scored)) < len(scored)
    assert len(trained) == len(set(trained)) == 14 * 32
    assert set(trained) <= set(scored)
    # What the dead buffer held was trained on after the kill, not dropped.
    trained_steps = {
        sid: r["step"] for r in read_jsonl(run_dir / "trained.jsonl") for sid in r["sequence_ids"]
    }
    assert max(trained_steps.values()) == 14
    assert len(killed) == 2


def test_dead_trainer_restarts_the_run_from_its_latest_checkpoint(
    undisturbed, tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    """A trainer killed after step 3 of 4 (checkpoints every 2 steps): the run restarts from step
    2's checkpoint by itself, the restored weights and AdamW state are the checkpoint's, and
    the run it finishes is the one it would have been undisturbed (synchronous, so exactly):
    the same trajectories trained at the same steps, losses and final weights."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    straight_dir, restarted_dir = undisturbed.run_dir, tmp_path / "restarted"
    run = start_tiny_run(tiny_model_dir, restarted_dir, 4, *DETERMINISTIC)
    restored: list[dict] = []
    restart = run._restart_from_checkpoint

    def restart_and_look(error):
        restart(error)
        restored.append({"step": run.state.step, **training_state(run)})

    run._restart_from_checkpoint = restart_and_look
    kill_at_steps(run, [(3, "training[0]")])
    try:
        state = run.run()
        run.save_final_checkpoint()
    finally:
        run.shutdown()

    assert state.step == 4
    assert [r.actor for r in run.recoveries] == ["training[0]"]
    assert run.recoveries[0].seconds_to_work is not None
    # Back at step 2 with exactly the checkpoint's weights, AdamW moments and step counts.
    assert [r["step"] for r in restored] == [2]
    assert_same_training_state(restored[0], undisturbed.states_at[2])
    assert run.steps_redone >= 1
    # The ledger marks the rewind; what stands is the undisturbed run's ledger.
    records = read_jsonl(restarted_dir / "trained.jsonl")
    assert [r["rewound_to"] for r in records if "rewound_to" in r] == [2]
    standing = records_after_rewinds(records)
    assert [r["step"] for r in standing] == [1, 2, 3, 4]
    assert [r["sequence_ids"] for r in standing] == [
        r["sequence_ids"] for r in read_jsonl(straight_dir / "trained.jsonl")
    ]
    assert trained_versions(restarted_dir) == trained_versions(straight_dir)
    # The redone steps' losses (the last logged for each step) and the final weights match.
    straight_losses, restarted_losses = losses(straight_dir), losses(restarted_dir)
    assert sorted(restarted_losses) == [1, 2, 3, 4]
    for step, value in straight_losses.items():
        assert restarted_losses[step] == pytest.approx(value, rel=1e-6, abs=1e-9)
    # metrics.jsonl marks the rewind too; what its readers (the plots) see is one standing
    # value per step: the undisturbed run's.
    metrics = read_jsonl(restarted_dir / "metrics.jsonl")
    assert [r["rewound_to"] for r in metrics if "rewound_to" in r] == [2]
    plotted = read_metrics(restarted_dir)[TRAIN_LOSS]
    assert [step for step, _ in plotted] == [1, 2, 3, 4]
    for step, value in plotted:
        assert value == pytest.approx(straight_losses[step], rel=1e-6, abs=1e-9)
    final_straight = load_file(straight_dir / "final" / "model.safetensors")
    final_restarted = load_file(restarted_dir / "final" / "model.safetensors")
    for name, tensor in final_straight.items():
        torch.testing.assert_close(final_restarted[name], tensor, rtol=1e-6, atol=1e-7)
    restarts = [
        r[FAULTS_STEPS_REDONE]
        for r in read_jsonl(restarted_dir / "metrics.jsonl")
        if FAULTS_STEPS_REDONE in r
    ]
    assert restarts == [float(run.steps_redone)]


def test_dead_trainer_past_the_restart_budget_stops_the_run_naming_it(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = start_run(tiny_model_dir, tmp_path / "run", 200, "orchestration.max_actor_restarts=0")
    killed = kill_at_steps(run, [(1, "training[0]")])
    try:
        with pytest.raises(ActorFailedError) as error:
            run.run()
        stopped_after = time.monotonic() - killed["training[0]"]
    finally:
        run.shutdown()
    # Noticed in a training step ("training[0] died") or in the weight gather after one
    # ("training[0] died during the weight gather").
    assert "training[0] died" in str(error.value)
    assert "max_actor_restarts=0" in str(error.value)
    assert "resume from the start (no checkpoint saved yet)" in str(error.value)
    # It names where the actors' own output is (their files in the run's logs folder).
    assert str(tmp_path / "run" / "logs") in str(error.value)
    # The loop notices within a couple of its 1 s waits, not after the stall timeout.
    assert stopped_after < 30, f"took {stopped_after:.1f} s to notice"
    assert run.state.step < 200


def test_actor_dying_too_often_stops_the_run_with_a_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    run = start_run(tiny_model_dir, run_dir, 200, "orchestration.max_actor_restarts=0")
    killed = kill_at_steps(run, [(1, "ref[0]")])
    try:
        with pytest.raises(ActorFailedError) as error:
            run.run()
        stopped_after = time.monotonic() - killed["ref[0]"]
    finally:
        run.shutdown()
    assert "ref[0] died 1 times" in str(error.value)
    assert "max_actor_restarts=0" in str(error.value)
    assert stopped_after < 60, f"took {stopped_after:.1f} s to stop"
    # A checkpoint of the step the run stopped at, with every trained step in it.
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    saved = json.loads((latest / "state.json").read_text())
    assert saved["step"] == run.state.step == len(read_jsonl(run_dir / "trained.jsonl"))
    assert (latest / "model" / "model.safetensors").is_file()


def test_an_actor_that_raises_stops_the_run_naming_the_root_cause(
    tiny_model_dir, tmp_path, monkeypatch, caplog, ray_shared
):
    """A collector whose batch raises (`WeightSyncError`, as after weight updates that kept
    failing verification) is not replaced: the run stops, and its one line names the exception
    the collector raised, not Ray's wrapper of it ("ray::SyncLLMCollector.generate_batch_...
    (pid=..., ip=...)"). Ray logs none of the remote tracebacks of the results the driver let
    go of unread ("Unhandled error"), which would reach the terminal after the stop line."""
    from grpo.observability.console import stop_reason
    from grpo.testing.faults import fail_next_batch, faults_at_steps

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = start_run(tiny_model_dir, tmp_path / "run", 200)
    faults_at_steps(run, [(1, "inference[0]", fail_next_batch)])
    try:
        with pytest.raises(ActorFailedError) as error:
            run.run()
    finally:
        run.shutdown()
    line = stop_reason(error.value)
    assert line.startswith("inference[0] failed (its output: "), line
    assert line.endswith(
        ": WeightSyncError: 3 weight updates in a row failed verification (injected)"
    ), line
    assert "ray::" not in line and "pid=" not in line
    assert not run.recoveries
    del run, error
    gc.collect()
    ray.shutdown()
    assert not [r.getMessage() for r in caplog.records if "Unhandled error" in r.getMessage()]


def kill_and_wait(actor: Any) -> None:
    """``ray.kill`` ``actor``, and return once a call to it fails: the kill is asynchronous,
    and a call sent right after it can still be answered."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    pytest.fail(f"{actor} still answers 60 s after ray.kill")


def test_non_finite_losses_stop_the_run_with_a_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    """Every step's loss is NaN: each is skipped and counted, the weights never move, and
    after max_nonfinite_steps_in_a_row the run stops with a checkpoint of where it was.

    Then a reference actor and the buffer, killed after the run stopped (between calls),
    are replaced when another checkpoint asks them for their state, and that checkpoint still
    holds every scored trajectory that was not trained on, or the record to generate its group
    again (what the dead buffer held)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    run = start_run(
        tiny_model_dir,
        run_dir,
        200,
        "training.loss._component_=grpo.testing.NonFiniteLoss",
        "orchestration.max_nonfinite_steps_in_a_row=2",
    )
    try:
        with pytest.raises(TrainingDivergedError) as error:
            run.run()
        checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
        state = json.loads((checkpoint / "state.json").read_text())
        saved = load_file(checkpoint / "model" / "model.safetensors")
        kill_and_wait(run.ref_actors[0])
        kill_and_wait(run.replay_buffer)
        after_kills = run.save_checkpoint()
    finally:
        run.shutdown()
    assert "2 training steps in a row" in str(error.value)
    assert "orchestration.max_nonfinite_steps_in_a_row=2" in str(error.value)
    assert run.state.step == 2
    skipped = [
        r["training/nonfinite_steps_skipped"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "training/nonfinite_steps_skipped" in r
    ]
    assert skipped == [1.0, 2.0]
    assert state["step"] == 2
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    for name, tensor in base.items():
        assert torch.equal(saved[name], tensor), f"{name} moved in a skipped step"

    assert sorted(r.actor for r in run.recoveries) == ["ref[0]", "replay_buffer"]
    pipeline = torch.load(after_kills / "pipeline.pt", weights_only=False)
    in_buffer = [t.sequence_id for t, _ in pipeline["replay_buffer"]["items"]]
    waiting = [t.sequence_id for group in pipeline["unbuffered_groups"] for t in group]
    unscored = [t.sequence_id for group in pipeline["unscored_groups"] for t in group.trajectories]
    trained = trained_ids(run_dir)
    scored = {sid for r in read_jsonl(run_dir / "scored.jsonl") for sid in r["sequence_ids"]}
    held = in_buffer + waiting
    again = [
        sid
        for r in pipeline["regenerate_records"]
        for sid in r.sequence_ids
        if sid not in r.exclude
    ]
    assert len(held) == len(set(held)) and not set(held) & set(trained)
    assert again and not set(again) & (set(held) | set(trained))
    # Nothing is stale after 2 steps (max_policy_lag 2), so every scored trajectory is
    # either trained, held in the checkpoint, or to be generated again under its id, and
    # the unscored ones are not scored yet.
    assert set(held) | set(trained) | set(again) == scored
    assert not set(unscored) & scored


def test_signal_stops_gracefully(undisturbed, tiny_model_dir, tmp_path):
    """SIGTERM (a scheduler's stop) ends a run in a process of its own after its current step:
    status 143, a checkpoint of the step it stopped at, no process left behind.

    The run extends a copy of the finished undisturbed run, asynchronously and with another
    lr: it goes on from the last step and runs that lr, the one its config.yaml records (each
    trainer rank applies the same settings: one trainer shows it). (Ctrl-C, SIGINT:
    `test_resume_continues_exactly`.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(undisturbed.run_dir, run_dir)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "grpo", "run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
            *deterministic_overrides(tiny_model_dir, run_dir, 500),
            "resume_from_checkpoint=true",
            "training.optimizer.lr=1e-4",
            "orchestration.synchronous=false",
            "orchestration.max_policy_lag=2",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trained = run_dir / "trained.jsonl"
    try:
        deadline = time.monotonic() + 300
        # Two steps past the 4 of the run it extends.
        while time.monotonic() < deadline and process.poll() is None:
            if trained.read_text().count("\n") >= 4 + 2:
                break
            time.sleep(0.5)
        assert process.poll() is None, process.communicate()[0][-3000:]
        children = descendants(process.pid)
        assert children, "the run started no processes"
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        output, _ = process.communicate(timeout=180)
        stop_seconds = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
    # 143 for SIGTERM: a script can tell an interrupted run from a finished one.
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert stop_seconds < 120
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), output[-3000:]
    checkpoint = run_dir / "checkpoints" / latest.read_text()
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == len(read_jsonl(trained)) >= 4 + 2
    assert (checkpoint / "model" / "model.safetensors").is_file()
    # No orphans: every process the run started is gone shortly after it exits.
    assert_all_gone(children)

    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert recorded["training"]["optimizer"]["lr"] == 1e-4
    lrs = {r["step"]: r[TRAIN_LR] for r in read_jsonl(run_dir / "metrics.jsonl") if TRAIN_LR in r}
    assert lrs == {
        **dict.fromkeys(range(1, 5), 3e-4),
        **dict.fromkeys(range(5, state["step"] + 1), 1e-4),
    }
