"""The orchestrator's parts on their own: step metrics, call dispatch (the in-flight ledger:
test_ledger.py).

The loop that wires them runs in tests/test_pipeline.py and tests/test_reliability.py; these
check each part's bookkeeping without Ray (object references are stand-in strings).
"""

from __future__ import annotations

import pytest

from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    METRIC_NAMES,
    REPLAY_BUFFER_DROPPED_STALE,
    REPLAY_BUFFER_SIZE,
    ROLLOUT_QUEUE_SIZE,
    TRAIN_PERF_STEP_WALL_TIME,
    TRAIN_PERF_TIME_DRIVER_OVERHEAD,
    TRAIN_PERF_TIME_ENGINE_RELOAD,
    TRAIN_PERF_TIME_GENERATION_BUSY,
    TRAIN_PERF_TIME_GRPO_STEPS,
    TRAIN_PERF_TIME_SCORING_BUSY,
    TRAIN_PERF_TIME_WAITING_BUFFER,
    TRAIN_PERF_TIME_WEIGHT_GATHER,
    TRAIN_PERF_TIME_WEIGHT_SYNC,
    TRAIN_PERF_TIME_WEIGHT_TRANSFER,
    TRAIN_PERF_TOTAL_STEP_TIME,
)
from grpo.observability.metrics import (
    WALL_PARTS,
    step_metrics,
    step_time_breakdown,
)
from grpo.orchestrator import RunState
from grpo.orchestrator.state import CallKind


def test_step_metrics_adds_queue_sizes_and_time_shares():
    metrics = step_metrics(
        {
            TRAIN_PERF_TOTAL_STEP_TIME: 4.0,
            TRAIN_PERF_TIME_GRPO_STEPS: 3.0,
            TRAIN_PERF_TIME_WAITING_BUFFER: 0.5,
            TRAIN_PERF_TIME_WEIGHT_SYNC: 0.25,
        },
        {"size": 12, "dropped_stale": 2},
        {ROLLOUT_QUEUE_SIZE: 3.0},
    )
    assert metrics[REPLAY_BUFFER_SIZE] == 12.0
    assert metrics[REPLAY_BUFFER_DROPPED_STALE] == 2.0
    assert metrics[ROLLOUT_QUEUE_SIZE] == 3.0
    assert metrics["training_perf/pct_time_grpo_steps (%)"] == pytest.approx(75.0)
    assert metrics["training_perf/pct_time_waiting_buffer (%)"] == pytest.approx(12.5)
    assert metrics["training_perf/pct_time_weight_sync (%)"] == pytest.approx(6.25)
    # A timing the step did not report gets no share.
    assert "training_perf/pct_time_weight_gather (%)" not in metrics


def test_run_state_round_trips():
    state = RunState(step=7, policy_version=5, eval_history=[(0, {EVAL_ACCURACY: 0.5})])
    restored = RunState()
    restored.load_state_dict(state.state_dict())
    assert (restored.step, restored.policy_version) == (7, 5)
    assert restored.eval_history == [(0, {EVAL_ACCURACY: 0.5})]


def test_every_kind_of_call_has_a_handler(tmp_path):
    from grpo.config import load_config
    from grpo.orchestrator import Orchestrator

    cfg = load_config("tiny_arithmetic_cpu", [f"output_dir={tmp_path}"])
    run = Orchestrator(cfg, tmp_path)
    assert set(run._handlers) == set(CallKind)
    # A replaced collector, reference actor, buffer or rollout queue redoes its call; a dead
    # trainer restarts the run from a checkpoint, so its calls are never redone.
    assert set(run.scheduler.redo) == set(CallKind) - {CallKind.TRAIN}


def test_step_time_breakdown_adds_up_to_the_wall_time():
    timings = {TRAIN_PERF_TIME_WEIGHT_GATHER: 0.05, TRAIN_PERF_TIME_WEIGHT_SYNC: 0.09}
    parts = step_time_breakdown(
        wall_s=1.0,
        buffer_wait_s=0.2,
        train_compute_s=0.5,
        sync_timings=timings,
        sync_wall_s=0.1,
        generation_busy_s=0.7,
        scoring_busy_s=0.3,
    )
    # No transfer time reported: the rest of the sync's wall time is the transfer.
    assert parts[TRAIN_PERF_TIME_WEIGHT_TRANSFER] == pytest.approx(0.05)
    assert parts[TRAIN_PERF_TIME_ENGINE_RELOAD] == 0.0
    assert parts[TRAIN_PERF_TIME_DRIVER_OVERHEAD] == pytest.approx(0.2)
    assert sum(parts[key] for key in WALL_PARTS) == pytest.approx(parts[TRAIN_PERF_STEP_WALL_TIME])
    # Busy times overlap training: reported, not part of the sum.
    assert (
        parts[TRAIN_PERF_TIME_GENERATION_BUSY] == 0.7 and parts[TRAIN_PERF_TIME_SCORING_BUSY] == 0.3
    )
    assert set(parts) <= set(METRIC_NAMES["training"])


def test_step_time_breakdown_uses_what_the_weight_sync_reports():
    timings = {
        TRAIN_PERF_TIME_WEIGHT_GATHER: 0.01,
        TRAIN_PERF_TIME_WEIGHT_TRANSFER: 0.02,
        TRAIN_PERF_TIME_ENGINE_RELOAD: 0.03,
    }
    parts = step_time_breakdown(1.0, 0.0, 0.5, timings, 0.1, 0.0, 0.0)
    assert [
        parts[TRAIN_PERF_TIME_WEIGHT_GATHER],
        parts[TRAIN_PERF_TIME_WEIGHT_TRANSFER],
        parts[TRAIN_PERF_TIME_ENGINE_RELOAD],
    ] == [
        0.01,
        0.02,
        0.03,
    ]
    # The sync's own wall time beyond what it reported is driver overhead.
    assert parts[TRAIN_PERF_TIME_DRIVER_OVERHEAD] == pytest.approx(0.44)
    # No sync on this step: its parts are 0.
    parts = step_time_breakdown(1.0, 0.3, 0.5, {}, 0.0, 0.0, 0.0)
    assert (
        parts[TRAIN_PERF_TIME_WEIGHT_GATHER]
        == parts[TRAIN_PERF_TIME_WEIGHT_TRANSFER]
        == parts[TRAIN_PERF_TIME_ENGINE_RELOAD]
        == 0.0
    )
    assert parts[TRAIN_PERF_TIME_DRIVER_OVERHEAD] == pytest.approx(0.2)


def test_the_ledger_read_without_rewound_steps_names_each_trajectory_once(tmp_path):
    """A trainer died in step 3 and the run went back to step 1's checkpoint: the first
    records of steps 2 and 3 no longer stand; a second rewind (to the start) drops all."""
    from grpo.observability.metrics import RunLedger, records_after_rewinds
    from grpo.testing import read_jsonl

    ledger = RunLedger(tmp_path)
    summary = {"group_ids": [0], "policy_versions": [0]}
    for step, ids in ((1, ["a"]), (2, ["b"]), (3, ["c"])):
        ledger.trained(step, {**summary, "sequence_ids": ids})
    ledger.rewound(1, from_step=3)
    for step, ids in ((2, ["b2"]), (3, ["c2"]), (4, ["d"])):
        ledger.trained(step, {**summary, "sequence_ids": ids})
    ledger.close()
    records = read_jsonl(tmp_path / "trained.jsonl")
    assert {"rewound_to": 1, "from_step": 3} in records
    standing = records_after_rewinds(records)
    assert [(r["step"], r["sequence_ids"]) for r in standing] == [
        (1, ["a"]),
        (2, ["b2"]),
        (3, ["c2"]),
        (4, ["d"]),
    ]
    assert records_after_rewinds([*records, {"rewound_to": 0, "from_step": 4}]) == []


def test_checkpoints_are_due_by_steps_and_by_minutes(tmp_path):
    from grpo.config import load_config
    from grpo.orchestrator.checkpointer import checkpoint_due

    def due(*overrides: str):
        cfg = load_config("tiny_arithmetic_cpu", [f"output_dir={tmp_path}", *overrides])
        every = cfg.checkpoint
        return lambda step, since_save=0.0: checkpoint_due(
            step, every.save_every_n_steps, every.save_every_n_minutes, since_save
        )

    by_steps = due("checkpoint.save_every_n_steps=5", "checkpoint.save_every_n_minutes=null")
    assert [s for s in range(1, 16) if by_steps(s)] == [5, 10, 15]
    by_minutes = due("checkpoint.save_every_n_minutes=1")
    assert not by_minutes(7)
    assert by_minutes(7, since_save=61.0)
    # The demo's interval, and the default for any config that sets none.
    cfg = load_config("tiny_arithmetic_cpu", [f"output_dir={tmp_path}"])
    assert cfg.checkpoint.save_every_n_steps is None
    from grpo.config.sections import CheckpointConfig

    assert CheckpointConfig().save_every_n_minutes == 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stall_watch_counts_only_trained_steps_as_progress():
    from grpo.orchestrator.stall import StallWatch

    clock = FakeClock()
    watch = StallWatch(60.0, clock=clock)
    clock.now += 59
    assert not watch.overdue()
    clock.now += 2
    assert watch.overdue() and watch.idle_s() == pytest.approx(61)
    watch.progressed()
    assert not watch.overdue()


def test_stall_watch_looks_when_overdue_at_most_every_look_interval_and_counts_replacements(
    caplog,
):
    from grpo.orchestrator.stall import CallInFlight, StallWatch

    clock = FakeClock()
    watch = StallWatch(15.0, clock=clock)
    assert watch.look_every_s == pytest.approx(5.0)  # a third of a short timeout
    assert StallWatch(600.0).look_every_s == pytest.approx(10.0)
    assert not watch.due()
    clock.now += 16
    assert watch.due() and not watch.due()  # one look, then the interval
    clock.now += 5
    assert watch.due()

    # Every actor working: no culprit, and the log says the run waits.
    generating = CallInFlight("GENERATE", "inference[0]", clock.now - 20)
    moving = {"in_engine_step_s": 0.01, "queue_wait_s": 0.0}
    with caplog.at_level("WARNING", logger="grpo"):
        assert watch.look([generating], {"inference[0]": moving}) is None
    assert "every actor is working" in caplog.text and "inference[0]" in caplog.text
    assert watch.stalls == 0 and watch.overdue()
    # A frozen collector: the message names the timeout and the actor, the stall is counted
    # and the clock starts again (its replacement starting up is not a stall).
    stall = watch.look([generating], {"inference[0]": None}, {"dropped_stale": 3.0})
    assert stall.replaceable and stall.actor == "inference[0]"
    assert stall.reason.startswith("no step trained for 21 s (orchestration.stall_timeout_s=15)")
    assert "inference[0] does not answer" in stall.reason
    assert watch.stalls == 1 and not watch.overdue() and not watch.due()


def test_stall_watch_names_who_holds_the_run_up():
    from grpo.orchestrator.stall import ENGINE_STEP_STUCK_S, CallInFlight, StallWatch

    clock = FakeClock()
    watch = StallWatch(60.0, clock=clock)
    watch.progressed(dropped_stale=10)
    clock.now += 61
    now = clock.now
    generating = CallInFlight("GENERATE", "inference[0]", now - 61)
    take = CallInFlight("TAKE", "rollout_queue", now - 0.2)
    sample = CallInFlight("SAMPLE", "replay_buffer", now - 3)
    moving = {"in_engine_step_s": 0.01, "queue_wait_s": 0.0}

    # A collector that does not answer its heartbeat is frozen: replace it.
    stall = watch.diagnose([generating, take, sample], {"inference[0]": None})
    assert (stall.actor, stall.replaceable) == ("inference[0]", True)
    assert "does not answer" in stall.reason
    # One stuck inside an engine step.
    stuck = {"in_engine_step_s": ENGINE_STEP_STUCK_S + 1, "queue_wait_s": 0.0}
    stall = watch.diagnose([generating], {"inference[0]": stuck})
    assert stall.actor == "inference[0]" and "engine step" in stall.reason
    # A trainer in one step for most of the timeout, while the collector waits on a full
    # queue behind it: the trainer.
    training = CallInFlight("TRAIN", "training[0]", now - 60)
    waiting = {"in_engine_step_s": 0.0, "queue_wait_s": 55.0}
    stall = watch.diagnose([generating, training, take], {"inference[0]": waiting})
    assert (stall.actor, stall.replaceable) == ("training[0]", True)
    assert "one training step for 60 s" in stall.reason
    # The oldest of several stuck calls; calls that come back on their own are not stuck.
    scoring = CallInFlight("SCORE", "ref[1]", now - 61)
    stall = watch.diagnose([training, scoring, take, sample], {})
    assert stall.actor == "ref[1]"
    # Nothing stuck, but samples dropped as stale since the last step, and again since the
    # previous look: the buffer, for good.
    assert watch.diagnose([take], {"inference[0]": moving}, {"dropped_stale": 30}, 0) is None
    stall = watch.diagnose(
        [generating, take, sample], {"inference[0]": moving}, {"dropped_stale": 42}, 0
    )
    assert (stall.actor, stall.replaceable) == ("replay_buffer", False)
    assert "dropped 32 trajectories as stale" in stall.reason
    assert "orchestration.max_policy_lag=0" in stall.reason
    # While a replacement catches up, its first samples are stale: that waits.
    stale = {"dropped_stale": 42}
    assert watch.diagnose([take], {"inference[0]": moving}, stale, 0, recovering=True) is None
    # A replaced buffer counts its drops from 0.
    stall = watch.diagnose([take], {"inference[0]": moving}, {"dropped_stale": 5}, 0)
    assert stall.actor == "replay_buffer" and "dropped 5 trajectories" in stall.reason
    # Everyone working, nothing dropped: a slow run, not a stalled one.
    assert (
        watch.diagnose([generating, take, sample], {"inference[0]": moving}, {"dropped_stale": 10})
        is None
    )


def test_an_actor_whose_constructor_raised_stops_the_run_instead_of_being_replaced(
    tmp_path, monkeypatch
):
    """Each replacement would raise the same way and add the same traceback to its log."""
    from ray.exceptions import RayActorError

    from grpo.config import load_config
    from grpo.errors import ActorFailedError
    from grpo.orchestrator import Orchestrator
    from grpo.orchestrator.state import Call

    cfg = load_config("tiny_arithmetic_cpu", [f"output_dir={tmp_path}"])
    run = Orchestrator(cfg, tmp_path)
    replaced = []
    monkeypatch.setattr(run.actors, "replace", lambda *args: replaced.append(args))

    def failed_start(ref):
        raise RayActorError(error_msg="ConfigError: environment: bad", actor_init_failed=True)

    monkeypatch.setattr("grpo.orchestrator.scheduler.ray.get", failed_start)
    collector = object()
    run.actors.collectors = [collector]
    run.scheduler.calls["ref"] = Call(CallKind.GENERATE, 0, collector)
    with pytest.raises(ActorFailedError, match=r"inference\[0\] failed to start.*: ConfigError"):
        run.scheduler.finish(["ref"], relaunch=True)
        run._handle_failures()
    assert not replaced


# ---------------------------------------------------------------- the fault policy


def policy(max_restarts: int = 1):
    from grpo.orchestrator.faults import FaultPolicy

    return FaultPolicy(max_restarts, lambda name: f" (its output: logs/{name}.log)", lambda: "ckpt")


def test_the_fault_policy_replaces_dead_actors_within_their_budget_then_stops():
    from grpo.orchestrator.faults import Failure, Replace, Stop

    faults = policy(max_restarts=1)
    gone = RuntimeError("gone")
    # (failure, the decision's type, its actor or words in its error); in order, one policy.
    table = [
        (Failure("ref[0]", gone), Replace, "ref[0]"),
        # Each actor has its own budget.
        (Failure("inference[1]", gone), Replace, "inference[1]"),
        # An earlier failure replaced it already: its other calls are redone, not counted.
        (Failure("ref[0]", gone, current=False), Replace, "ref[0]"),
        # Past the budget: replaced once more (the pipeline stays whole for a checkpoint),
        # and the decision carries the stop for the end of the step.
        (Failure("ref[0]", gone), Replace, "ref[0] died 2 times"),
        # The same actor dying again while the run stops: stop now.
        (Failure("ref[0]", gone), Stop, "ref[0] died 2 times"),
        # Raising is never replaced: the root cause, named.
        (Failure("replay_buffer", ValueError("bad"), died=False), Stop, "replay_buffer failed"),
        # A constructor that raised would raise again in every replacement.
        (Failure("inference[0]", gone, init_failed=True), Stop, "inference[0] failed to start"),
    ]
    for failure, kind, text in table:
        decision = faults.decide(failure)
        assert isinstance(decision, kind), (failure, decision)
        if isinstance(decision, Replace):
            assert decision.actor == failure.actor
            assert (decision.last is not None) == ("died" in text)
            assert text in str(decision.last or decision.actor)
        else:
            assert text in str(decision.error)
    assert "max_actor_restarts=1" in str(faults.decide(Failure("ref[0]", gone)).error)
    assert "(its output: logs/ref[0].log); last error: gone" in str(faults.last)


def test_a_dead_trainer_restarts_the_run_until_the_budget_is_used_up():
    from grpo.orchestrator.faults import Failure, Restart, Stop

    faults = policy(max_restarts=1)
    decision = faults.decide(Failure("training[1]", RuntimeError("killed")))
    assert decision == Restart(
        "training[1] died (RuntimeError: killed) (its output: logs/training[1].log)"
    )
    # The budget is counted where the restart is carried out: a training call, a weight
    # gather or a checkpoint that found the trainer dead.
    assert faults.restart(decision.reason) == Restart(decision.reason)
    stop = faults.restart("training[0] died during the weight gather")
    assert isinstance(stop, Stop)
    assert str(stop.error) == (
        "training[0] died during the weight gather; the training actors died 2 times "
        "(orchestration.max_actor_restarts=1): resume from ckpt"
    )


def test_a_stop_names_the_root_cause_not_rays_wrapper():
    """A collector that raised in a remote call: the message names the exception it raised,
    not Ray's "ray::SyncLLMCollector.generate_batch_with_state() (pid=..., ...)" header."""
    from ray.exceptions import RayTaskError

    from grpo.errors import describe, root_cause
    from grpo.orchestrator.faults import Failure

    class WeightSyncError(RuntimeError):
        pass

    cause = WeightSyncError("3 weight updates in a row failed verification")
    header = "ray::SyncLLMCollector.generate_batch_with_state() (pid=12, ip=10.0.0.1)"
    wrapped = RayTaskError(
        "generate_batch_with_state", f"{header}\nTraceback ...\n", cause, pid=12, ip="10.0.0.1"
    ).as_instanceof_cause()
    assert str(wrapped).startswith("ray::") or "Traceback" in str(wrapped)
    # A remote call inside a remote call: the innermost user exception.
    nested = RayTaskError("score", "ray::RefActor.score()", wrapped)
    assert root_cause(wrapped) is cause and root_cause(nested) is cause
    line = "WeightSyncError: 3 weight updates in a row failed verification"
    assert describe(nested) == line
    assert describe(KeyError("anwser")) == "KeyError: 'anwser'"
    stop = policy().decide(Failure("inference[0]", wrapped, died=False))
    assert str(stop.error) == f"inference[0] failed (its output: logs/inference[0].log): {line}"


def test_an_actor_death_is_described_in_one_line():
    """Ray's text of a killed actor spans lines (class, ids, pid, the reason); the log line of
    its replacement and a trainer restart's reason keep the first line and the reason."""
    from ray.exceptions import RayActorError

    from grpo.errors import describe
    from grpo.orchestrator.faults import Failure, Restart

    text = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RefActor\n"
        "\tactor_id: 9eba7d\n\tpid: 19295\n\tip: 192.0.2.2\nThe actor is dead because its "
        "worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: ..."
    )
    died = RayActorError(error_msg=text)
    assert describe(died) == (
        "RayActorError: The actor died unexpectedly before finishing this task: its worker "
        "process has died"
    )
    restart = policy().decide(Failure("training[0]", died))
    assert isinstance(restart, Restart) and "\n" not in restart.reason


# ---------------------------------------------------------------- the failing-reward guard

TYPO = "NameError: name 'completon' is not defined (at /home/me/my_rewards.py:6 in short: ...)"
HANG = "no result within 10.0 s"


def reward_calls(calls: int, exceptions: int = 0, timeouts: int = 0, name: str = "short"):
    """One batch's calls of reward ``name`` (`RewardCalls.as_dict`), and a healthy one's."""
    reason = TYPO if exceptions else HANG if timeouts else None
    return {
        name: {"calls": calls, "timeouts": timeouts, "exceptions": exceptions, "reason": reason},
        "math": {"calls": calls, "timeouts": 0, "exceptions": 0, "reason": None},
    }


# (batches, as (collector, calls, exceptions, timeouts), then what check says: None or words)
REWARD_GUARD_CASES = [
    # Every call raises: stops at the third batch, naming the function, the error and the line.
    ([(0, 8, 8, 0), (1, 8, 8, 0), (1, 8, 8, 0)], "'short' failed nearly every call: 24 of its 24"),
    # Two batches are not enough, however many calls.
    ([(0, 64, 64, 0), (0, 64, 64, 0)], None),
    # Three batches of 4 calls: 12, below the 16 a decision needs; a fourth makes 16.
    ([(0, 4, 4, 0)] * 3, None),
    ([(0, 4, 4, 0)] * 4, "16 of its 16 calls in the last 4 generation batches"),
    # Occasional failures (a third) keep scoring the failure reward.
    ([(0, 8, 3, 0)] * 10, None),
    # 90% is enough: an odd call that gets through does not hide a broken function.
    ([(0, 10, 9, 0)] * 3, "27 of its 30 calls"),
    # Timeouts count too, and are said apart from exceptions.
    ([(0, 8, 0, 8)] * 3, "(24 timed out (over reward_timeout_s)): no result within 10.0 s"),
    ([(0, 8, 4, 4)] * 3, "(12 raised and 12 timed out"),
    # The newest batches decide: a function fixed (by a restart) goes on.
    ([(0, 8, 8, 0)] * 2 + [(0, 8, 0, 0)] * 3, None),
]


@pytest.mark.parametrize("batches, expected", REWARD_GUARD_CASES)
def test_the_reward_guard_stops_a_run_whose_reward_fails_nearly_every_call(batches, expected):
    from grpo.errors import RewardFailingError
    from grpo.orchestrator.reward_failures import RewardFailures

    guard = RewardFailures(lambda index: f" (its output: logs/inference_{index}.log)")
    guard.batch(0, None)  # a batch that called no reward function says nothing
    guard.batch(0, {})
    for collector, calls, exceptions, timeouts in batches:
        guard.batch(collector, reward_calls(calls, exceptions, timeouts))
    if expected is None:
        guard.check()
        return
    with pytest.raises(RewardFailingError) as error:
        guard.check()
    message = str(error.value)
    assert expected in message and "\n" not in message
    assert message.startswith("reward function 'short' failed nearly every call")
    assert "'math'" not in message  # the healthy function is not blamed
    if "raised" in message:
        assert TYPO in message
    if batches[0][0] != batches[-1][0]:
        assert "(its output: logs/inference_1.log)" in message  # the collector that saw it most


def test_equal_rewards_from_a_failing_reward_blame_the_reward_not_the_task(caplog):
    """One batch of a broken reward already makes every group equal (all score the failure
    reward): the first episodes' warning names the reward's error, before its guard can stop
    the run, instead of advising a bigger group or a stronger model."""
    import logging

    from grpo.orchestrator.group_counts import GroupCounts
    from grpo.orchestrator.reward_failures import RewardFailures

    guard = RewardFailures(lambda index: f" (its output: logs/inference_{index}.log)")
    counts = GroupCounts(filtering=True, timeout_s=120.0, causes=[guard])
    guard.batch(0, reward_calls(64, exceptions=64))
    with caplog.at_level(logging.WARNING, logger="grpo"):
        counts.scored(8, num_zero_variance=8, num_dropped=8, group_rewards=[[0.0] * 8] * 8)
    [record] = caplog.records
    assert "64 of the last 64 calls of reward function 'short' failed" in record.message
    assert TYPO.split(" (at")[0] in record.message and "logs/inference_0.log" in record.message
    assert "group_size" not in record.message
    # A function that fails now and then is no cause: the task is.
    assert RewardFailures().note() is None
    healthy = RewardFailures()
    healthy.batch(0, reward_calls(64, exceptions=10))
    assert healthy.note() is None
