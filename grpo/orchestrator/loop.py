"""The loop: keeps one call in flight per actor and reacts to whichever finishes first.

Generation, reference scoring and training overlap, and a dead actor surfaces at once
(`ray.wait`) instead of as a hang. Each kind of call has one handler (`CallKind` -> bound
method in `Orchestrator._handlers`), and one way to be redone after its actor was replaced
(`Orchestrator._redo`). A dead trainer takes the policy and optimizer state with it; the loop
then restarts the pipeline from the latest checkpoint and redoes the steps after it
(`Orchestrator._restart_from_checkpoint`). The policy version is tracked in one place,
`RunState.policy_version`, set only from the trainer's weight payload
(`Orchestrator._sync_weights`); stale data is dropped in one place, the replay buffer (see
`grpo.orchestrator.ledger`).

The driver never fetches trajectories: the buffer's `sample_batch` waits inside the buffer
until a batch is there and returns it as its own object, which goes to the trainers as a
reference, next to a small summary (ids, buffer stats) that the ledger and metrics read. The
one exception is debug logging (``debug_logging_enabled``), whose tables decode the batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from grpo.config import RunConfig
from grpo.errors import ActorFailedError, RunStalledError, TrainerDiedError, TrainingDivergedError
from grpo.observability.metric_names import (
    FAULTS_STEPS_REDONE,
    INFERENCE_GROUPS_NOT_QUEUED,
    INFERENCE_TIME_GENERATION,
    REF_PERF_NAMESPACE,
    REF_PERF_TIME_WAITING_BUFFER,
    REF_PERF_TOTAL_ROLLOUT_TIME,
    ROLLOUT_QUEUE_SIZE,
    TRAIN_NONFINITE_STEPS_IN_A_ROW,
    TRAIN_PERF_TIME_TRAIN_COMPUTE,
    TRAIN_PERF_TIME_WAITING_BUFFER,
    ratio_metrics,
)
from grpo.observability.metrics import (
    RunLedger,
    debug_tables,
    step_metrics,
    step_time_breakdown,
)
from grpo.orchestrator.checkpointer import Checkpointer, find_checkpoint
from grpo.orchestrator.episode_drops import EpisodeDrops
from grpo.orchestrator.group_counts import GroupCounts
from grpo.orchestrator.ledger import InFlightLedger
from grpo.orchestrator.reward_failures import RewardFailures
from grpo.orchestrator.stall import CallInFlight, StallWatch
from grpo.orchestrator.state import Call, CallKind, RunState
from grpo.orchestrator.supervisor import (
    ActorSupervisor,
    Recovery,
    Role,
    actor_name,
    actor_started,
)
from grpo.run_folder import CHECKPOINTS_DIR, LATEST_FILE
from grpo.weights.concurrency import COLLECTOR_HEALTH_GROUP
from grpo.weights.sync import HEARTBEAT_TIMEOUT_S, START_UP_LIMIT_S, WeightSync

log = logging.getLogger("grpo")

# Most groups one reference call scores (they are packed together for the forward).
_GROUPS_PER_REF_CALL = 4
# Most seconds one sample call waits inside the buffer for a batch before it returns empty and
# is asked again. Short enough that a buffer that died or a stop is noticed soon.
_SAMPLE_WAIT_S = 5.0
# Tries at starting the actors again after a trainer died (see _restart_from_checkpoint).
_RESTART_ATTEMPTS = 3
# Once no step was trained for stall_timeout_s: seconds between two looks at who holds the
# run up.
_STALL_CHECK_EVERY_S = 10.0


class Orchestrator:
    """Wires the parts of a run and drives its actors until the last training step.

    Args:
        cfg (RunConfig): The run config.
        run_dir (Path): Folder for logs and checkpoints.
        tokenizer: Decodes debug tables (optional).
        dataset: The training dataset, built once by the recipe; None builds it from
            ``cfg.dataset`` in each collector.
    """

    def __init__(
        self, cfg: RunConfig, run_dir: Path, tokenizer: Any = None, dataset: Any = None
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.state = RunState()
        self.run_ledger = RunLedger(self.run_dir)
        self.actors = ActorSupervisor(
            cfg, self.run_dir, self._log, lambda: self.state.step, dataset=dataset
        )
        self.actors.on_replaced = {
            Role.COLLECTOR: self._catch_up_collector,
            Role.REPLAY_BUFFER: self._refill_replay_buffer,
            Role.ROLLOUT_QUEUE: self._rescue_queued_groups,
        }
        self.inflight = InFlightLedger()
        self.weights = self._new_weight_sync()
        self.checkpointer = Checkpointer(
            self.run_dir,
            self.state,
            [self.actors, self.inflight],
            self._save_trainers,
            config=cfg.model_dump(),
        )
        # Where the actors started from (a resumed checkpoint, or None: the base model), their
        # pad id, and the steps redone after trainer restarts (see _restart_from_checkpoint).
        self.start_checkpoint: Path | None = None
        self._pad_token_id = 0
        self.steps_redone = 0
        self._saved_at = time.monotonic()  # of the last checkpoint, or the start
        self.synchronous = cfg.orchestration.synchronous
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint
        self.synced_step = 0  # the step whose weights the collectors were sent last
        self._calls: dict[Any, Call] = {}
        self._handlers = {
            CallKind.GENERATE: self._on_generated,
            CallKind.TAKE: self._on_taken,
            CallKind.SCORE: self._on_scored,
            CallKind.ADD: self._on_added,
            CallKind.SAMPLE: self._on_sampled,
            CallKind.TRAIN: self._on_trained,
        }
        self._redo = {
            CallKind.GENERATE: lambda call: self._launch_collector(call.index),
            CallKind.TAKE: lambda call: self._feed_ref_slot(call.index),
            CallKind.SCORE: lambda call: self._launch_score(call.index, call.payload[0]),
            CallKind.ADD: lambda call: self._pump_buffer_adds(),
            CallKind.SAMPLE: lambda call: self._launch_sample(),
        }
        self._idle_ref_slots: set[int] = set()
        # Per reference slot: when it started waiting for groups, and how long it waited.
        self._waiting_since: dict[int, float] = {}
        self._waited: dict[int, float] = {}
        # (batch ref, summary) of the last sample call; (None, None) when it found no batch.
        self._sampled: tuple[Any, dict[str, Any] | None] | None = None
        self._train_results: dict[int, dict[str, Any]] = {}  # by rank, for the current step
        # Seconds collectors generated and reference actors scored in calls that finished
        # during the current step (they run beside training, so they overlap its wall time).
        self._busy = {"generation": 0.0, "scoring": 0.0}
        # Episodes the environment failed per generation batch, and the guard that stops a run
        # whose environment fails nearly every episode (checked first: see _check_data_guards).
        self.episode_drops = EpisodeDrops(
            lambda index: self.actors.output_hint(actor_name(Role.COLLECTOR, index))
        )
        # Reward calls per generation batch, and the guard that stops a run whose reward
        # function fails nearly every call (checked as each batch comes back: the failure
        # rewards still fill batches, so the run would train on).
        self.reward_failures = RewardFailures(
            lambda index: self.actors.output_hint(actor_name(Role.COLLECTOR, index))
        )
        # Groups scored and dropped for equal rewards per step, the first episodes' reward
        # distribution (a warning when every group was equal), and the guard that stops a run
        # whose groups all have equal rewards (ref.filter_zero_variance_groups).
        self.group_counts = GroupCounts(
            cfg.ref.filter_zero_variance_groups,
            cfg.orchestration.equal_rewards_timeout_s,
            causes=(self.episode_drops, self.reward_failures),
        )
        # Progress is a trained step; without one for stall_timeout_s, who holds the run up
        # is named and replaced, or the run stops naming it (`_wait`, `_on_stall`).
        self.stall_watch = StallWatch(cfg.orchestration.stall_timeout_s)
        self._next_stall_check = 0.0
        self.stalls = 0  # actors killed because they held the run up
        self._answered: set[str] = set()  # ids of actors that answered a call: started up
        self._buffer_stats: dict[str, float] = {}

    def _new_weight_sync(self) -> WeightSync:
        return WeightSync(
            self.actors.get_all,
            wait_for_receipt=self.cfg.orchestration.synchronous,
            config=self.cfg.weight_sync,
            replace_collector=self._replace_collector,
        )

    def _replace_collector(self, index: int, collector: Any, error: Exception) -> None:
        """A collector that cannot receive weights: killed, replaced and caught up."""
        self.actors.kill(actor_name(Role.COLLECTOR, index), str(error))
        self.actors.replace(Role.COLLECTOR, index, collector, error)

    # The current actors (replacements included), for the recipe, evaluation and tests.
    collectors = property(lambda self: self.actors.collectors)
    ref_actors = property(lambda self: self.actors.ref_actors)
    trainers = property(lambda self: self.actors.trainers)
    replay_buffer = property(lambda self: self.actors.replay_buffer)
    rollout_queue = property(lambda self: self.actors.rollout_queue)
    metric_logger = property(lambda self: self.actors.metric_logger)

    @property
    def recoveries(self) -> list[Recovery]:
        """Every dead actor that was replaced, in order."""
        return self.actors.recoveries

    # ------------------------------------------------------------------ start-up

    def start_actors(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> None:
        """Start every actor of the run in order.

        Args:
            pad_token_id (int): The tokenizer's pad id (for packing).
            checkpoint_dir (Path | None): A checkpoint to resume from (`find_checkpoint`):
                trainers and collectors start from its weights; `restore` loads the rest.
        """
        self.start_checkpoint, self._pad_token_id = checkpoint_dir, pad_token_id
        self.actors.start_all(pad_token_id, checkpoint_dir)

    def restore(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint's run and pipeline state into freshly started actors."""
        self.checkpointer.load(checkpoint_dir)
        self.checkpointed_step = self.synced_step = self.state.step

    def resume(self, checkpoint_dir: Path) -> None:
        """Go on from a checkpoint an earlier run saved (``resume_from_checkpoint``).

        `restore`, and the metric logger goes on in that run's W&B run; what the earlier run
        logged after this checkpoint is redone, which the logger marks as a rewind
        (`MetricLogger.resumed`).
        """
        self.restore(checkpoint_dir)
        logger = self.actors.metric_logger
        if logger is not None and hasattr(logger, "resumed"):  # a custom logger may lack it
            logger.resumed.remote(self.state.step)

    def request_stop(self, signum: int | None = None) -> None:
        """Ask the loop to stop at the next step boundary (signal handlers call this).

        Args:
            signum (int | None): The signal that asked, kept in ``stop_signal`` so that the
                process can exit with ``128 + signum`` as shells expect (130 for Ctrl-C).
        """
        self.stop_requested = True
        self.stop_signal = signum

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.actors.metric_logger is not None and metrics:
            self.actors.metric_logger.log_dict.remote(metrics, step=step)

    # ------------------------------------------------------------------ launching calls

    def _launch(self, ref: Any, kind: CallKind, index: int, actor: Any, payload: Any = None):
        self._calls[ref] = Call(kind, index, actor, payload)

    def _launch_collector(self, index: int) -> None:
        actor = self.collectors[index]
        # The second return, the batch's groups, is held (never fetched) until they are
        # scored: what a dead rollout queue held is scored from there (`_rescue_queued_groups`).
        info_ref, groups_ref = actor.generate_batch_with_state.options(num_returns=2).remote(
            self.cfg.inference.batch_size
        )
        self._launch(info_ref, CallKind.GENERATE, index, actor, (groups_ref, self.rollout_queue))

    def _launch_score(self, index: int, groups_ref: Any) -> None:
        now = time.perf_counter()
        self._waited[index] = now - self._waiting_since.pop(index, now)
        actor = self.ref_actors[index]
        info_ref, scored_ref = actor.score.options(num_returns=2).remote(groups_ref)
        self._launch(info_ref, CallKind.SCORE, index, actor, (groups_ref, scored_ref))

    def _feed_ref_slot(self, index: int) -> None:
        """Give reference actor ``index`` work: waiting groups first, then the queue.

        While more scored batches wait for room in the buffer than there are reference
        actors, the slot stays idle: back-pressure reaches the queue, then the collectors.
        """
        self._idle_ref_slots.discard(index)
        self._waiting_since.setdefault(index, time.perf_counter())
        if self.inflight.unscored:
            self._launch_score(index, self.inflight.unscored.popleft())
        elif len(self.inflight.to_buffer) > len(self.ref_actors):
            self._idle_ref_slots.add(index)
        else:
            timeout_s = 0.0 if self.synchronous else 0.5
            count_ref, groups_ref = self.rollout_queue.take(_GROUPS_PER_REF_CALL, timeout_s)
            self._launch(count_ref, CallKind.TAKE, index, self.rollout_queue, groups_ref)

    def _launch_sample(self) -> None:
        """Ask the buffer for a batch; it answers once it has one (or after a while, empty).

        A synchronous run looks once: nothing is generated while it waits.
        """
        actor = self.replay_buffer
        timeout_s = 0.0 if self.synchronous else _SAMPLE_WAIT_S
        # The trainers' weights are the policy version of ``state.step`` (a version counts
        # training steps), synced to the collectors or not: staleness is counted from it.
        summary_ref, batch_ref = actor.sample_batch.options(num_returns=2).remote(
            self.cfg.training.batch_size, self.state.step, timeout_s
        )
        # The driver reads only the summary; the trainers read the batch.
        self._launch(summary_ref, CallKind.SAMPLE, 0, actor, payload=batch_ref)

    def _wait(self, timeout_s: float) -> list[Any]:
        """The calls that finished within ``timeout_s`` (at most one); the one place the loop
        waits for its actors, so the stall watch looks after every wait.

        Raises:
            RunStalledError: No step was trained for ``stall_timeout_s`` and replacing the
                actor that holds the run up cannot help.
        """
        ready, _ = ray.wait(list(self._calls), num_returns=1, timeout=timeout_s)
        now = time.monotonic()
        if self.stall_watch.overdue() and now >= self._next_stall_check:
            self._next_stall_check = now + _STALL_CHECK_EVERY_S
            self._on_stall()
        return ready

    def _on_stall(self) -> None:
        """No step trained for ``stall_timeout_s``: name who holds the run up, and replace it
        (kill it: its call in flight then fails and the supervisor replaces it like an actor
        that died) or stop the run.

        Raises:
            RunStalledError: When replacing cannot help; the message names the actor.
        """
        timeout_s = self.stall_watch.timeout_s
        # Calls that finished but were not handed to their handler yet are not stuck.
        finished = set(ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)[0])
        now = time.monotonic()

        # An actor that has not answered once yet is starting up (a vLLM engine loading a
        # large model takes minutes): its silence is not a stall until it took too long.
        def started_up(call: Call) -> bool:
            if call.actor_id in self._answered or now - call.started > START_UP_LIMIT_S:
                return True
            if actor_started(call.actor):
                self._answered.add(call.actor_id)
                return True
            return False

        pending = [call for ref, call in self._calls.items() if ref not in finished]
        generating = {
            actor_name(Role.COLLECTOR, c.index): c for c in pending if c.kind is CallKind.GENERATE
        }
        beats = {
            name: call.actor.heartbeat.options(concurrency_group=COLLECTOR_HEALTH_GROUP).remote()
            for name, call in generating.items()
        }
        ray.wait(list(beats.values()), num_returns=len(beats), timeout=HEARTBEAT_TIMEOUT_S)
        heartbeats: dict[str, dict[str, Any] | None] = {}
        for name, ref in beats.items():
            try:
                heartbeats[name] = ray.get(ref, timeout=0)
                self._answered.add(generating[name].actor_id)
            except (ray.exceptions.GetTimeoutError, RayActorError):
                if started_up(generating[name]):
                    heartbeats[name] = None  # frozen, or dead (replaced when its call fails)
        calls = [
            CallInFlight(c.kind.name, actor_name(c.kind.role, c.index), c.started)
            for c in pending
            if c.kind is not CallKind.GENERATE and started_up(c)
        ]
        stall = self.stall_watch.diagnose(
            calls,
            heartbeats,
            self._buffer_stats,
            self.cfg.orchestration.max_policy_lag,
            # A replacement's first samples carry the weights it started from until it caught
            # up: drops as stale then say nothing about the lag.
            recovering=bool(self.actors.recovering),
        )
        idle = self.stall_watch.idle_s()
        if stall is None:
            log.warning(
                "no step trained for %.0f s (orchestration.stall_timeout_s=%g), but every actor "
                "is working (calls in flight: %s); waiting",
                idle,
                timeout_s,
                sorted({call.actor for call in calls} | set(generating)),
            )
            return
        message = (
            f"no step trained for {idle:.0f} s (orchestration.stall_timeout_s={timeout_s:g}): "
            f"{stall.actor} {stall.reason}"
        )
        if not stall.replaceable:
            raise RunStalledError(message)
        log.warning("%s; replacing it", message)
        self.stalls += 1
        self._log({"faults/stalls": float(self.stalls)}, self.state.step)
        self.actors.kill(stall.actor, message)
        # Its replacement starts up before it works again: that is not a stall.
        self.stall_watch.progressed(self._buffer_stats.get("dropped_stale"))

    def _in_flight(self, kind: CallKind) -> bool:
        return any(call.kind is kind for call in self._calls.values())

    def _pump_buffer_adds(self) -> None:
        """Offer the oldest waiting scored batch to the buffer (one add in flight, in order)."""
        batch = self.inflight.next_to_add()
        if batch is None or self._in_flight(CallKind.ADD):
            return
        actor = self.replay_buffer
        ref = actor.add_groups.remote(batch.groups_ref, batch.added, batch.skip)
        self._launch(ref, CallKind.ADD, 0, actor, batch)

    def _wake_idle_ref_slots(self) -> None:
        for index in sorted(self._idle_ref_slots):
            if len(self.inflight.to_buffer) <= len(self.ref_actors):
                self._feed_ref_slot(index)

    # ------------------------------------------------------------------ results

    def _process(self, ready: list[Any], relaunch: bool) -> None:
        """Hand each finished call to its handler; ``relaunch`` keeps the pipeline busy.

        Raises:
            ActorFailedError: An actor raised, failed to start, or died and cannot be
                replaced; the message names it.
        """
        for ref in ready:
            call = self._calls.pop(ref)
            role = call.kind.role
            try:
                result = ray.get(ref)
            except RayActorError as error:
                if error.actor_init_failed:
                    # Its constructor raised: each replacement would raise the same way (and
                    # add the same traceback to the actor's log file), so the run stops here.
                    name = actor_name(role, call.index)
                    raise ActorFailedError(
                        f"{name} failed to start{self.actors.output_hint(name)}: {error}"
                    ) from error
                # Replace the dead actor (unless already replaced) and redo the call.
                self.actors.replace(role, call.index, call.actor, error)
                self._redo[call.kind](call)
                continue
            except RayTaskError as error:
                name = actor_name(role, call.index)
                raise ActorFailedError(f"{name} failed: {error}") from error
            self.actors.returned(role, call.index, call.actor)
            self._answered.add(call.actor_id)
            self._handlers[call.kind](call, result, relaunch)

    def _on_generated(self, call: Call, result: Any, relaunch: bool) -> None:
        self._log(result["metrics"], self.state.step)
        self.episode_drops.batch(call.index, result.get("dropped_episodes"))
        self.reward_failures.batch(call.index, result.get("reward_calls"))
        self.reward_failures.check()
        self._busy["generation"] += result["metrics"].get(INFERENCE_TIME_GENERATION, 0.0)
        self.actors.collector_states[call.index] = result["state"]
        groups_ref, queue = call.payload
        if result["metrics"].get(INFERENCE_GROUPS_NOT_QUEUED) and queue is self.rollout_queue:
            # The collector found the queue dead before the loop did.
            name = actor_name(Role.COLLECTOR, call.index)
            self.actors.replace(
                Role.ROLLOUT_QUEUE, 0, queue, RuntimeError(f"{name} could not put groups on it")
            )
        # A batch that began before the queue was replaced may have lost groups with it.
        self.inflight.generated(groups_ref, result["group_ids"], queue is not self.rollout_queue)
        if relaunch:
            self._launch_collector(call.index)

    def _on_taken(self, call: Call, result: Any, relaunch: bool) -> None:
        if result:
            self._launch_score(call.index, call.payload)
        elif relaunch:
            self._feed_ref_slot(call.index)

    def _on_scored(self, call: Call, result: Any, relaunch: bool) -> None:
        step = self.state.step
        waited = self._waited.pop(call.index, 0.0)
        busy = result["metrics"][REF_PERF_TOTAL_ROLLOUT_TIME]
        self.state.last_scored_metrics = result["metrics"]
        self._busy["scoring"] += busy
        metrics = {
            **result["metrics"],
            REF_PERF_TIME_WAITING_BUFFER: waited,
            **ratio_metrics(
                REF_PERF_NAMESPACE, {REF_PERF_TIME_WAITING_BUFFER: waited}, waited + busy
            ),
        }
        self._log(metrics, step)
        # Dropped groups were scored too: recorded, so that they do not look lost.
        dropped = [sid for ids in result["dropped_sequence_ids"] for sid in ids]
        kept = [sid for ids in result["sequence_ids"] for sid in ids]
        self.run_ledger.scored(step, kept + dropped, dropped)
        self.group_counts.scored(
            len(result["group_ids"]) + len(result["dropped_group_ids"]),
            result["num_zero_variance_groups"],
            len(result["dropped_group_ids"]),
            result["group_rewards"],
        )
        self.inflight.scored(call.payload[1], result)
        self._pump_buffer_adds()
        if relaunch:
            self._feed_ref_slot(call.index)

    def _on_added(self, call: Call, result: Any, relaunch: bool) -> None:
        self.inflight.added(call.payload, result)
        self._pump_buffer_adds()
        if relaunch:
            self._wake_idle_ref_slots()

    def _on_sampled(self, call: Call, summary: dict[str, Any], relaunch: bool) -> None:
        self._buffer_stats = summary["stats"]
        if summary["sequence_ids"] is None:
            stats = summary["stats"]
            if self.inflight.buffer_full and stats["size"] < stats["capacity"]:
                # Stale trajectories were dropped: there is room for the adds that waited.
                self.inflight.buffer_full = False
                self._pump_buffer_adds()
            if relaunch:
                self._launch_sample()  # it waited in the buffer already: no back-off here
            else:
                self._sampled = (None, None)
        else:
            self.inflight.sampled(summary["sequence_ids"])
            self._pump_buffer_adds()
            self._sampled = (call.payload, summary)

    def _on_trained(self, call: Call, result: Any, relaunch: bool) -> None:
        self._train_results[call.index] = result

    def _drain(self, held: list[Any] | None = None) -> None:
        """Let every call in flight finish, launching no new generation or queue take.

        Scoring and buffer adds of what is already taken still run. If ``held`` is given the
        queue is emptied into it meanwhile, which lets a collector blocked on a full queue
        finish its batch.
        """
        while self._calls:
            if held is not None:
                self._empty_queue_into(held)
            self._process(self._wait(0.2), relaunch=False)
        if held is not None:
            self._empty_queue_into(held)

    def _empty_queue_into(self, held: list[Any]) -> None:
        """Move what the rollout queue holds into ``held`` (a dead queue is replaced)."""
        queue = self.rollout_queue
        try:
            if count := queue.qsize():
                held.extend(queue.get_nowait_batch(count))
        except RayActorError as error:
            self.actors.replace(Role.ROLLOUT_QUEUE, 0, queue, error)

    def _queue_size(self) -> int:
        """Groups in the rollout queue; a dead queue is replaced (the new one holds none)."""
        queue = self.rollout_queue
        try:
            return queue.qsize()
        except RayActorError as error:
            self.actors.replace(Role.ROLLOUT_QUEUE, 0, queue, error)
            return 0

    # ------------------------------------------------------------------ replacements

    def _catch_up_collector(self, index: int, collector: Any) -> None:
        """A new collector at the state of the old one's last finished batch, current weights."""
        state = self.actors.collector_states[index]
        self.weights.catch_up(collector, state, actor_name(Role.COLLECTOR, index), index)

    def _rescue_queued_groups(self, index: int, queue: Any) -> None:
        """A new, empty rollout queue: the collectors put onto it from now on, and the groups
        the dead one may have held are scored from the driver's copies.

        The driver holds every generation batch's groups (`_launch_collector`) until each of
        them has been scored; those not scored yet go to the reference actors as if taken from
        the queue. Some of them were taken before the queue died and are being scored already:
        the copy scored second is recognised by its ``group_id`` and skipped
        (`InFlightLedger.scored`), so each group is trained on once. Logs
        ``faults/groups_rescued``: the groups not scored yet when the queue died.
        """
        for collector in range(len(self.collectors)):
            self.actors.ask(Role.COLLECTOR, collector, "set_rollout_queue", queue)
        rescued = self.inflight.rescue_queued()
        self._log({"faults/groups_rescued": float(rescued)}, self.state.step)

    def _refill_replay_buffer(self, index: int, buffer: Any) -> None:
        """A new buffer holding what the old one held: scored groups not yet sampled."""
        calls = [
            buffer.add_groups.remote(groups_ref, 0, absent)
            for groups_ref, absent in self.inflight.buffer_contents()
        ]
        self.actors.get_all(calls, "replay_buffer rebuild")

    # ------------------------------------------------------------------ the loop

    def run(self, evaluate: Any = None, on_step: Any = None) -> RunState:
        """Drive the actors until ``orchestration.num_steps`` training steps are done.

        Args:
            evaluate (callable | None): ``evaluate(step) -> dict`` run before the first step,
                every ``eval_every_n_steps`` and at the end.
            on_step (callable | None): ``on_step(state)`` after each training step (progress).

        Returns:
            RunState: Final step, policy version and last metrics.

        Raises:
            ActorFailedError: An actor raised, a trainer died, or an actor died more often
                than ``max_actor_restarts`` (then after saving a checkpoint); its name is in
                the message.
            TrainingDivergedError: ``orchestration.max_nonfinite_steps_in_a_row`` steps in a row
                were skipped for a non-finite loss (after saving a checkpoint).
            NoInformativeGroupsError: With ``ref.filter_zero_variance_groups``, every
                group had equal rewards for ``orchestration.equal_rewards_timeout_s`` of
                waiting.
            EnvironmentFailingError: Nearly every episode of the last generation batches was
                dropped because the environment raised (`EpisodeDrops`).
            RewardFailingError: Nearly every call of a reward function in the last generation
                batches raised or timed out (`RewardFailures`).
        """
        cfg = self.cfg
        num_steps = cfg.orchestration.num_steps
        eval_every = cfg.eval_every_n_steps or 0
        if evaluate is not None and self.state.step == 0:
            self.state.eval_history.append((0, evaluate(0)))
        self._saved_at = time.monotonic()
        self.stall_watch.progressed()

        while self.state.step < num_steps and not self.stop_requested:
            try:
                if not self._step(evaluate, eval_every):
                    break  # stop requested while waiting
            except TrainerDiedError as error:
                self._restart_from_checkpoint(error)
                self.stall_watch.progressed()
                continue
            if on_step is not None:
                on_step(self.state)

        done = self.state.step >= num_steps
        if evaluate is not None and done and (not eval_every or num_steps % eval_every):
            self.state.eval_history.append((num_steps, evaluate(num_steps)))
        return self.state

    def _step(self, evaluate: Any, eval_every: int) -> bool:
        """One training step, its weight sync, evaluation and checkpoint.

        Returns:
            bool: False if a stop was requested before a batch was there.
        """
        cfg = self.cfg
        step_start = time.perf_counter()
        self._busy = dict.fromkeys(self._busy, 0.0)
        if self.synchronous:
            batch_ref, summary, waited = self._next_batch_synchronously()
        else:
            batch_ref, summary, waited = self._next_batch_asynchronously()
        if summary is None:
            return False
        if cfg.inference.sleep_while_training:  # synchronous: nothing generates meanwhile
            self._sleep_collectors()
        metrics = self._train(batch_ref, summary, waited)
        self._after_train_step(
            metrics, batch_ref, summary, cfg.weight_sync.every_n_steps, step_start
        )
        step = self.state.step
        if evaluate is not None and eval_every and step % eval_every == 0:
            self.state.eval_history.append((step, evaluate(step)))
            self.stall_watch.progressed(self._buffer_stats.get("dropped_stale"))
        self._stop_if_failing(metrics)
        if self._checkpoint_due(step):
            self.save_checkpoint()
        # Evaluation and checkpoints take their time between steps; that is not a stall.
        self.stall_watch.progressed(self._buffer_stats.get("dropped_stale"))
        return True

    def _start_from(self, checkpoint: Path | None) -> None:
        """Start every actor but the metric logger from ``checkpoint`` (None: the run's start)
        and load its state; the driver's in-flight state starts empty."""
        self.inflight = InFlightLedger()
        self.checkpointer.pipeline = [self.actors, self.inflight]
        retries, self.weights = self.weights.retries, self._new_weight_sync()
        self.weights.retries = retries  # the run's count goes on
        self._buffer_stats, self._answered = {}, set()
        self.actors.restart_pipeline(self._pad_token_id, checkpoint)
        if checkpoint is not None:
            self.restore(checkpoint)
        else:
            self.state.step = self.state.policy_version = self.synced_step = 0
            self.state.eval_history = [e for e in self.state.eval_history if e[0] == 0]
            self.checkpointed_step = None

    def _checkpoint_due(self, step: int) -> bool:
        """Every ``checkpoint.save_every_n_steps`` steps, or ``save_every_n_minutes`` after
        the last checkpoint (or the start of the loop)."""
        every_steps = self.cfg.checkpoint.save_every_n_steps
        every_minutes = self.cfg.checkpoint.save_every_n_minutes
        if every_steps and step % every_steps == 0:
            return True
        return bool(every_minutes) and time.monotonic() - self._saved_at >= 60 * every_minutes

    def _restart_from_checkpoint(self, error: TrainerDiedError) -> None:
        """After a trainer died: start every actor but the metric logger again from the
        latest checkpoint (or from where the run started) and go on from its step.

        The run then is the run that would have continued from that checkpoint: the same
        stream positions, buffered and held groups, policy version and weights. Steps after it
        are redone with newly generated trajectories; what the lost steps trained on is
        discarded with the weights that learned from it, and the run ledger marks the rewind
        (`RunLedger.rewound`), so each trajectory counts once in the weights that go on. The
        metric logger marks it too (`MetricLogger.rewound`): the lost steps' metrics are
        superseded by the redone steps' in the curves and plots.

        Raises:
            ActorFailedError: The trainers died more than ``max_actor_restarts`` times.
        """
        recovery = self.actors.trainer_died(error)
        died_at = self.state.step
        saved_one = (self.run_dir / CHECKPOINTS_DIR / LATEST_FILE).is_file()
        checkpoint = find_checkpoint(self.run_dir, True) if saved_one else self.start_checkpoint
        self._calls.clear()
        self._idle_ref_slots.clear()
        self._waiting_since.clear()
        self._waited.clear()
        self._sampled, self._train_results = None, {}
        for attempt in range(1, _RESTART_ATTEMPTS + 1):
            try:
                self._start_from(checkpoint)
                break
            except ActorFailedError as failure:
                # A new actor placed on a node that was dying (Ray marks a lost node dead
                # some seconds after its processes die) dies too: start them all again.
                if attempt == _RESTART_ATTEMPTS:
                    raise
                log.warning("restart attempt %d failed (%s); trying again", attempt, failure)
                time.sleep(2.0 * attempt)
        self.steps_redone += died_at - self.state.step
        self.run_ledger.rewound(self.state.step, died_at)
        logger = self.actors.metric_logger
        if logger is not None and hasattr(logger, "rewound"):  # a custom logger may lack it
            # After every record of the lost steps, before any of the redone ones: what they
            # logged first is superseded (`MetricLogger.rewound`).
            logger.rewound.remote(self.state.step, died_at)
        recovery.seconds = time.perf_counter() - recovery.started
        self.actors.record_recovery(recovery)
        self._log({FAULTS_STEPS_REDONE: float(self.steps_redone)}, self.state.step)
        log.warning(
            "restarted from %s at step %d (%d steps to redo)",
            checkpoint or "the start",
            self.state.step,
            died_at - self.state.step,
        )

    def _stop_if_failing(self, metrics: dict[str, Any]) -> None:
        """Checkpoint and raise after an actor used up its restarts, or the loss diverged."""
        if self.actors.gave_up is not None:
            self.save_checkpoint()
            raise self.actors.gave_up
        limit = self.cfg.orchestration.max_nonfinite_steps_in_a_row
        in_a_row = int(metrics.get(TRAIN_NONFINITE_STEPS_IN_A_ROW, 0))
        if in_a_row >= limit:
            saved = self.save_checkpoint()
            raise TrainingDivergedError(
                f"{in_a_row} training steps in a row (up to step {self.state.step}) had a "
                "non-finite loss or gradient norm and were skipped "
                f"(orchestration.max_nonfinite_steps_in_a_row={limit}); saved {saved}. Lower "
                "training.optimizer.lr or check the rewards and the data."
            )

    def _next_batch_asynchronously(self) -> tuple[Any, dict[str, Any] | None, float]:
        """Keep collectors and reference actors busy until the buffer yields a batch."""
        if not self._in_flight(CallKind.GENERATE):
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            for index in range(len(self.ref_actors)):
                self._feed_ref_slot(index)
        wait_start = time.perf_counter()
        waiting_since = time.monotonic()
        self._sampled = None
        self._launch_sample()
        while not self.stop_requested:
            # Every episode dropped, or every group dropped for equal rewards: this names that
            # cause, before the stall watch would look for a stuck actor.
            self._check_data_guards(waiting_since)
            self._process(self._wait(1.0), relaunch=True)
            if self._sampled is not None:
                batch_ref, summary = self._sampled
                return batch_ref, summary, time.perf_counter() - wait_start
        if self._in_flight(CallKind.SAMPLE):
            # Stopping: the waiting sample returns empty now instead of taking a batch that
            # would then not be trained on.
            self.replay_buffer.release_waiters.remote()
        return None, None, 0.0

    def _next_batch_synchronously(self) -> tuple[Any, dict[str, Any] | None, float]:
        """Generate with the current weights and score everything, then sample a batch.

        One generation round per collector at a time, as many rounds as it takes: with
        ``ref.filter_zero_variance_groups`` a round may leave fewer trajectories than a
        batch needs (or none), and the next round makes up for it. `GroupCounts.check` stops
        a run whose rounds keep yielding only groups with equal rewards.
        """
        wait_start = time.perf_counter()
        waiting_since = time.monotonic()
        while not self.stop_requested:
            self._sampled = None
            self._launch_sample()
            while self._sampled is None:
                self._drain()
            batch_ref, summary = self._sampled
            if summary is not None:
                return batch_ref, summary, time.perf_counter() - wait_start
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            self._drain()
            self._score_everything_queued()
            self._check_data_guards(waiting_since)
        return None, None, 0.0

    def _check_data_guards(self, waiting_since: float) -> None:
        """Stop a run that generates but cannot fill a batch: the environment failing nearly
        every episode first (the few episodes left have equal rewards too, and the rewards
        are not the cause), then every group having equal rewards."""
        self.episode_drops.check()
        self.group_counts.check(waiting_since)

    def _score_everything_queued(self) -> None:
        """Score until the queue and the waiting groups are empty."""
        while True:
            for index in range(len(self.ref_actors)):
                self._feed_ref_slot(index)
            self._drain()
            if not self.inflight.unscored and self._queue_size() == 0:
                return

    def _sleep_collectors(self) -> None:
        """Put every collector's engine to sleep before the trainers step: they share the GPU
        (``inference.sleep_while_training``). Each wakes for its next batch or weight check,
        loads the weights synced meanwhile and probes them (`grpo.workers.engine_sleep`).

        Raises:
            ActorFailedError: A collector raised, or died and cannot be replaced.
        """
        calls = [(c, c.sleep_engine.remote()) for c in self.collectors]
        for index, (collector, ref) in enumerate(calls):
            try:
                metrics = ray.get(ref)
            except RayActorError as error:
                # It died between batches: its replacement starts awake, and sleeps too.
                self.actors.replace(Role.COLLECTOR, index, collector, error)
                metrics = self.actors.ask(Role.COLLECTOR, index, "sleep_engine")
            except RayTaskError as error:
                name = actor_name(Role.COLLECTOR, index)
                raise ActorFailedError(f"{name} failed to sleep: {error}") from error
            # The sleep and wake that ended with this step's generation.
            self._log(metrics, self.state.step)

    def _train(self, batch_ref: Any, summary: dict[str, Any], waited: float) -> dict[str, Any]:
        """Train every rank on the batch behind ``batch_ref``; rank 0's metrics.

        Each rank receives the whole batch (one object in the store, read by every rank) and
        trains on its own share of it (`PyTorchActorModel.train_step`).
        """
        cfg = self.cfg
        debug_ids = None
        if cfg.debug_logging_enabled and self.tokenizer is not None:
            debug_ids = summary["sequence_ids"][: cfg.debug_num_samples_per_step]
        self._train_results = {}
        for rank, trainer in enumerate(self.trainers):
            ref = trainer.train_step.remote(batch_ref, waited, debug_ids)
            self._launch(ref, CallKind.TRAIN, rank, trainer)
        # Collectors and reference actors keep working while the trainers step.
        while len(self._train_results) < len(self.trainers):
            self._process(self._wait(1.0), relaunch=not self.synchronous)
        self.run_ledger.trained(self.state.step + 1, summary)
        return self._train_results[0]

    def _after_train_step(
        self,
        metrics: dict[str, Any],
        batch_ref: Any,
        summary: dict[str, Any],
        sync_every: int,
        step_start: float,
    ) -> None:
        self.state.step += 1
        step = self.state.step
        self.stall_watch.progressed(summary["stats"].get("dropped_stale"))
        metrics = dict(metrics)
        pi_logprobs = metrics.pop("debug_pi_logprobs", None)
        if pi_logprobs and self.metric_logger is not None:
            # Debug logging only: the tables decode the batch, so the driver fetches it.
            batch = ray.get(batch_ref)
            for name, (columns, rows) in debug_tables(
                batch, pi_logprobs, self.tokenizer, step
            ).items():
                self.metric_logger.log_table.remote(rows, columns, name, step=step)
        # Read before the sync: the version these steps trained with.
        queues = {
            ROLLOUT_QUEUE_SIZE: float(self._queue_size()),
            "queues/replay_buffer_batches_waiting": float(len(self.inflight.to_buffer)),
            "queues/replay_buffer_duplicate_groups": float(self.inflight.num_duplicate_groups),
            "train_actor_training/policy_version": float(self.state.policy_version),
            **self.group_counts.step_metrics(),
        }
        sync_timings: dict[str, float] = {}
        sync_start = time.perf_counter()
        if step % sync_every == 0:
            sync_timings = self._sync_weights()
            metrics.update(sync_timings)
        sync_wall = time.perf_counter() - sync_start
        metrics.update(
            step_time_breakdown(
                wall_s=time.perf_counter() - step_start,
                buffer_wait_s=metrics.get(TRAIN_PERF_TIME_WAITING_BUFFER, 0.0),
                train_compute_s=metrics.get(TRAIN_PERF_TIME_TRAIN_COMPUTE, 0.0),
                sync_timings=sync_timings,
                sync_wall_s=sync_wall if sync_timings else 0.0,
                generation_busy_s=self._busy["generation"],
                scoring_busy_s=self._busy["scoring"],
            )
        )
        self.state.last_metrics = step_metrics(metrics, summary["stats"], queues)
        self._log(self.state.last_metrics, step)
        # The sync (which may have replaced a collector) is the driver's time, not a stall.
        self.stall_watch.progressed(summary["stats"].get("dropped_stale"))

    def _sync_weights(self) -> dict[str, float]:
        """Send the trainers' weights to every collector; the one place the version moves."""
        retries = self.weights.retries
        self.state.policy_version, timings = self.weights.sync(self.trainers, self.collectors)
        self.synced_step = self.state.step
        if self.weights.retries != retries:
            self._log(
                {"faults/weight_transfer_retries": float(self.weights.retries)}, self.state.step
            )
        self.inflight.release_stale(
            self.state.policy_version - self.cfg.orchestration.max_policy_lag
        )
        return timings

    # ------------------------------------------------------------------ checkpoints, the end

    def _save_trainers(self, folder: Path) -> None:
        self.actors.get_all(
            [t.save_checkpoint.remote(str(folder)) for t in self.trainers], "trainer checkpoint"
        )

    def save_checkpoint(self) -> Path:
        """Save everything a run needs to continue exactly, atomically.

        Steps trained since the last weight sync are published first, so the checkpoint's
        weights are the policy version it records. The pipeline is quiesced: collectors finish their batch (the queue is emptied
        meanwhile so none stays blocked) and reference actors finish scoring. Groups taken
        from the queue and scored groups still waiting for room in the buffer go into the
        checkpoint, and stay with the driver to be scored and added as before.

        Returns:
            Path: The checkpoint folder ``run_dir/checkpoints/step_NNNNNN``.
        """
        start = time.perf_counter()
        if self.synced_step != self.state.step:
            # A checkpoint is a weight sync: its weights then are a version the collectors
            # received, and a run resumed from it labels what it samples with that version.
            self._sync_weights()
        held: list[Any] = []
        self._drain(held=held)
        if held:
            self.inflight.unscored.append(ray.put(held))
        final = self.checkpointer.save(self.state.step)
        self.checkpointed_step = self.state.step
        self._saved_at = time.monotonic()
        self._log({"checkpoint/time (s)": time.perf_counter() - start}, self.state.step)
        log.info("saved checkpoint %s", final)
        return final

    def verify_weight_sync(self) -> bool:
        """Check that every collector computes with exactly the trainer's current weights.

        Pending weights are applied first. Logs ``weight_sync/in_sync`` (1 or 0).

        Returns:
            bool: True if every collector's checksum equals the trainer's.
        """
        in_sync = self.weights.verify(self.trainers, self.collectors)
        self._log({"weight_sync/in_sync": float(in_sync)}, self.state.step)
        return in_sync

    def save_final_checkpoint(self) -> Path:
        """Save the policy as an HF-format folder ``run_dir/final``."""
        out_dir = self.run_dir / "final"
        self.actors.get_all(
            [t.save_hf_checkpoint.remote(str(out_dir)) for t in self.trainers], "trainer checkpoint"
        )
        return out_dir

    def shutdown(self) -> None:
        """End every actor of the run (idempotent)."""
        self.run_ledger.close()
        self.actors.shutdown()
