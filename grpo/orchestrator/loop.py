"""The loop: a training step at a time, with generation and scoring running beside it.

Every wait goes through `_poll`, the one place faults are handled: the fault policy turns a
failed call into a decision (replace the actor, restart from the latest checkpoint, stop) and
`_handle_failures` carries it out. The policy version is set in one place, `_sync_weights`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from grpo.config import RunConfig
from grpo.errors import ActorFailedError, RunStalledError, TrainerDiedError
from grpo.observability.metric_names import (
    FAULTS_STEPS_REDONE,
    ROLLOUT_QUEUE_SIZE,
    TRAIN_NONFINITE_STEPS_IN_A_ROW,
    TRAIN_PERF_TIME_TRAIN_COMPUTE,
    TRAIN_PERF_TIME_WAITING_BUFFER,
)
from grpo.observability.metrics import RunLedger, debug_tables, step_metrics, step_time_breakdown
from grpo.orchestrator.checkpointer import Checkpointer, checkpoint_due, find_checkpoint
from grpo.orchestrator.episode_drops import EpisodeDrops
from grpo.orchestrator.faults import Failure, FaultPolicy, Replace, Restart, Stop, diverged
from grpo.orchestrator.group_counts import GroupCounts
from grpo.orchestrator.ledger import InFlightLedger
from grpo.orchestrator.reward_failures import RewardFailures
from grpo.orchestrator.scheduler import Busy, Failed, SampledBatch, Scheduler
from grpo.orchestrator.stall import StallWatch
from grpo.orchestrator.state import CallKind, RunState
from grpo.orchestrator.supervisor import ActorSupervisor, Recovery, Role, actor_name
from grpo.run_folder import CHECKPOINTS_DIR, LATEST_FILE, latest_checkpoint_text
from grpo.weights.sync import WeightSync

log = logging.getLogger("grpo")

# Tries at starting the actors again after a trainer died (see _restart_from_checkpoint).
_RESTART_ATTEMPTS = 3


def _weight_sync(cfg: RunConfig, actors: ActorSupervisor) -> WeightSync:
    return WeightSync(
        actors.get_all, wait_for_receipt=cfg.orchestration.synchronous, config=cfg.weight_sync
    )


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
        self.actors = ActorSupervisor(cfg, self.run_dir, lambda: self.state.step, dataset=dataset)
        self.faults = FaultPolicy(
            cfg.orchestration.max_actor_restarts,
            self.actors.output_hint,
            lambda: latest_checkpoint_text(self.run_dir),
        )
        self.weights = _weight_sync(cfg, self.actors)
        inflight = InFlightLedger(cfg.orchestration.num_inference_workers)
        self.checkpointer = Checkpointer(
            self.run_dir,
            self.state,
            [self.actors, inflight],
            lambda folder: self.actors.save_trainers(folder),
            config=cfg.model_dump(),
        )
        # Episodes the environment failed and reward calls that failed, per generation batch:
        # the guards that stop a run whose environment fails nearly every episode, or whose
        # reward function fails nearly every call (checked as each batch comes back: failure
        # rewards still fill batches, so the run would train on).
        hint = lambda index: self.actors.output_hint(actor_name(Role.INFERENCE, index))  # noqa: E731
        episode_drops, reward_failures = EpisodeDrops(hint), RewardFailures(hint)
        # Groups scored and dropped for equal rewards per step, and the guard that stops a run
        # whose groups all have equal rewards (ref.filter_zero_variance_groups).
        self.group_counts = GroupCounts(
            cfg.ref.filter_zero_variance_groups,
            cfg.orchestration.equal_rewards_timeout_s,
            causes=(episode_drops, reward_failures),
        )
        self.scheduler = Scheduler(
            cfg,
            self.actors,
            inflight,
            self.state,
            self.run_ledger,
            self.actors.log_metrics,
            episode_drops,
            reward_failures,
            self.group_counts,
        )
        # Progress is a trained step; without one for stall_timeout_s, who holds the run up
        # is named and replaced, or the run stops naming it (`_poll`).
        self.stall_watch = StallWatch(cfg.orchestration.stall_timeout_s)
        # Where the actors started from (a resumed checkpoint, or None: the base model), their
        # pad id, and the steps redone after trainer restarts (see _restart_from_checkpoint).
        self.start_checkpoint: Path | None = None
        self._pad_token_id = 0
        self.steps_redone = 0
        self._saved_at = time.monotonic()  # of the last checkpoint, or the start
        self.stop_requested = False
        self.stop_signal: int | None = None
        # An actor that used up its restarts was replaced once more: the run stops with this
        # after the current step, with a checkpoint (`Replace.last`).
        self._stopping: ActorFailedError | None = None
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint
        self.synced_step = 0  # the step whose weights the collectors were sent last

    # The current actors (replacements included), for the recipe, evaluation and tests.
    collectors = property(lambda self: self.actors.collectors)
    ref_actors = property(lambda self: self.actors.ref_actors)
    trainers = property(lambda self: self.actors.trainers)
    replay_buffer = property(lambda self: self.actors.replay_buffer)
    rollout_queue = property(lambda self: self.actors.rollout_queue)
    metric_logger = property(lambda self: self.actors.metric_logger)
    inflight = property(lambda self: self.scheduler.inflight)
    recoveries = property(lambda self: self.actors.recoveries)  # every replacement, in order
    stalls = property(lambda self: self.stall_watch.stalls)  # actors killed for holding it up
    # Each kind of call's handler (tests wrap one to act at a given moment).
    _handlers = property(lambda self: self.scheduler.handlers)

    # ------------------------------------------------------------------ start-up

    def start_actors(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> None:
        """Start every actor of the run in order.

        Args:
            pad_token_id (int): The tokenizer's pad id (for packing).
            checkpoint_dir (Path | None): A checkpoint to resume from (`find_checkpoint`):
                trainers and collectors start from its weights; `resume` loads the rest.
        """
        self.start_checkpoint, self._pad_token_id = checkpoint_dir, pad_token_id
        self.actors.start_metric_logger()
        self.actors.start_pipeline(pad_token_id, checkpoint_dir)

    def resume(self, checkpoint_dir: Path) -> None:
        """Go on from a checkpoint an earlier run saved (``resume_from_checkpoint``).

        Its run and pipeline state go into the freshly started actors, and the metric logger
        goes on in that run's W&B run; what the earlier run logged after this checkpoint is
        redone, which the logger marks as a rewind (`MetricLogger.resumed`).
        """
        self.checkpointer.load(checkpoint_dir)
        self.checkpointed_step = self.synced_step = self.state.step
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
            ActorFailedError: An actor raised, or died more often than ``max_actor_restarts``
                (then after saving a checkpoint, unless it was a trainer); the message names
                it and the root cause.
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
        num_steps = self.cfg.orchestration.num_steps
        eval_every = self.cfg.eval_every_n_steps or 0
        if evaluate is not None and self.state.step == 0:
            self.state.eval_history.append((0, evaluate(0)))
        self._saved_at = time.monotonic()
        self.stall_watch.progressed()
        while self.state.step < num_steps and not self.stop_requested:
            try:
                if not self._step(evaluate, eval_every):
                    break  # stop requested while waiting
            except TrainerDiedError as error:
                decision = self.faults.restart(str(error))
                if isinstance(decision, Stop):
                    raise decision.error from error
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
        self.scheduler.busy = Busy()
        if cfg.orchestration.synchronous:
            batch, waited = self._next_batch_synchronously()
        else:
            batch, waited = self._next_batch_asynchronously()
        if batch is None:
            return False
        if cfg.inference.sleep_while_training:  # synchronous: nothing generates meanwhile
            self._sleep_collectors()
        debug_ids = None
        if cfg.debug_logging_enabled and self.tokenizer is not None:
            debug_ids = batch.summary["sequence_ids"][: cfg.debug_num_samples_per_step]
        self.scheduler.launch_train(batch, waited, debug_ids)
        # Collectors and reference actors keep working while the trainers step.
        while len(self.scheduler.train_results) < len(self.trainers):
            self._poll(1.0, relaunch=not cfg.orchestration.synchronous)
        self.run_ledger.trained(self.state.step + 1, batch.summary)
        metrics = self.scheduler.train_results[0]  # rank 0's
        self._after_train_step(metrics, batch, step_start)
        step, dropped_stale = self.state.step, self.scheduler.buffer_stats.get("dropped_stale")
        if evaluate is not None and eval_every and step % eval_every == 0:
            self.state.eval_history.append((step, evaluate(step)))
            self.stall_watch.progressed(dropped_stale)
        in_a_row = int(metrics.get(TRAIN_NONFINITE_STEPS_IN_A_ROW, 0))
        limit = cfg.orchestration.max_nonfinite_steps_in_a_row
        if self._stopping is not None or in_a_row >= limit:
            saved = self.save_checkpoint()
            raise self._stopping or diverged(in_a_row, limit, step, saved)
        since_save = time.monotonic() - self._saved_at
        every = cfg.checkpoint
        if checkpoint_due(step, every.save_every_n_steps, every.save_every_n_minutes, since_save):
            self.save_checkpoint()
        # Evaluation and checkpoints take their time between steps; that is not a stall.
        self.stall_watch.progressed(dropped_stale)
        return True

    def _next_batch_asynchronously(self) -> tuple[SampledBatch | None, float]:
        """Keep collectors and reference actors busy until the buffer yields a batch."""
        scheduler = self.scheduler
        if not scheduler.in_flight(CallKind.GENERATE):
            for index in range(len(self.collectors)):
                scheduler.launch_collector(index)
            for index in range(len(self.ref_actors)):
                scheduler.feed_ref_slot(index)
        wait_start, waiting_since = time.perf_counter(), time.monotonic()
        scheduler.batch = None
        scheduler.launch_sample()
        while not self.stop_requested:
            # Every episode dropped, or every group dropped for equal rewards: this names that
            # cause, before the stall watch would look for a stuck actor.
            scheduler.episode_drops.check()
            self.group_counts.check(waiting_since)
            self._poll(1.0, relaunch=True)
            if scheduler.batch is not None:
                return scheduler.batch, time.perf_counter() - wait_start
        if scheduler.in_flight(CallKind.SAMPLE):
            # Stopping: the waiting sample returns empty now instead of taking a batch that
            # would then not be trained on.
            self.replay_buffer.release_waiters.remote()
        return None, 0.0

    def _next_batch_synchronously(self) -> tuple[SampledBatch | None, float]:
        """Generate with the current weights and score everything, then sample a batch.

        One generation round per collector at a time, as many rounds as it takes: with
        ``ref.filter_zero_variance_groups`` a round may leave fewer trajectories than a
        batch needs (or none), and the next round makes up for it. `GroupCounts.check` stops
        a run whose rounds keep yielding only groups with equal rewards.
        """
        scheduler = self.scheduler
        wait_start, waiting_since = time.perf_counter(), time.monotonic()
        while not self.stop_requested:
            scheduler.batch = None
            scheduler.launch_sample()
            self._drain()  # the sample looks once: a batch, or none yet
            if scheduler.batch is not None:
                return scheduler.batch, time.perf_counter() - wait_start
            for index in range(len(self.collectors)):
                scheduler.launch_collector(index)
            self._drain()
            # Score until the queue and the waiting groups are empty.
            while True:
                for index in range(len(self.ref_actors)):
                    scheduler.feed_ref_slot(index)
                self._drain()
                if not self.inflight.unscored and scheduler.queue_size() == 0:
                    break
            self._handle_failures()  # a dead queue found while reading its size
            # The environment failing nearly every episode first (the few episodes left have
            # equal rewards too, and the rewards are not the cause), then equal rewards.
            scheduler.episode_drops.check()
            self.group_counts.check(waiting_since)
        return None, 0.0

    def _after_train_step(
        self, metrics: dict[str, Any], batch: SampledBatch, step_start: float
    ) -> None:
        """Count the step, sync the weights on schedule, and log the step's metrics."""
        self.state.step += 1
        step, stats = self.state.step, batch.summary["stats"]
        self.stall_watch.progressed(stats.get("dropped_stale"))
        metrics = dict(metrics)
        pi_logprobs = metrics.pop("debug_pi_logprobs", None)
        if pi_logprobs and self.metric_logger is not None:
            # Debug logging only: the tables decode the batch, so the driver fetches it.
            tables = debug_tables(ray.get(batch.ref), pi_logprobs, self.tokenizer, step)
            for name, (columns, rows) in tables.items():
                self.metric_logger.log_table.remote(rows, columns, name, step=step)
        # Read before the sync: the version these steps trained with.
        queues = {
            ROLLOUT_QUEUE_SIZE: float(self.scheduler.queue_size()),
            "queues/replay_buffer_batches_waiting": float(len(self.inflight.to_buffer)),
            "queues/replay_buffer_duplicate_groups": float(self.inflight.num_duplicate_groups),
            "training/policy_version": float(self.state.policy_version),
            **self.group_counts.step_metrics(),
        }
        sync_timings: dict[str, float] = {}
        sync_start = time.perf_counter()
        if step % self.cfg.weight_sync.every_n_steps == 0:
            sync_timings = self._sync_weights()
            metrics.update(sync_timings)
        sync_wall = time.perf_counter() - sync_start
        busy = self.scheduler.busy
        metrics.update(
            step_time_breakdown(
                wall_s=time.perf_counter() - step_start,
                buffer_wait_s=metrics.get(TRAIN_PERF_TIME_WAITING_BUFFER, 0.0),
                train_compute_s=metrics.get(TRAIN_PERF_TIME_TRAIN_COMPUTE, 0.0),
                sync_timings=sync_timings,
                sync_wall_s=sync_wall if sync_timings else 0.0,
                generation_busy_s=busy.generation,
                scoring_busy_s=busy.scoring,
            )
        )
        self.state.last_metrics = step_metrics(metrics, stats, queues)
        self.actors.log_metrics(self.state.last_metrics, step)
        # The sync (which may have replaced a collector) is the driver's time, not a stall.
        self.stall_watch.progressed(stats.get("dropped_stale"))
        self._handle_failures()  # a dead queue found while reading its size

    def _sync_weights(self) -> dict[str, float]:
        """Send the trainers' weights to every collector; the one place the version moves."""
        retries = self.weights.retries
        self.state.policy_version, timings = self.weights.sync(self.trainers, self.collectors)
        self._handle_failures()  # collectors that could not receive: replaced, caught up
        self.synced_step = self.state.step
        if self.weights.retries != retries:
            self.actors.log_metrics(
                {"faults/weight_transfer_retries": float(self.weights.retries)}, self.state.step
            )
        self.inflight.release_stale(
            self.state.policy_version - self.cfg.orchestration.max_policy_lag
        )
        return timings

    # ------------------------------------------------------------------ waiting, faults

    def _poll(self, timeout_s: float, relaunch: bool) -> None:
        """Wait up to ``timeout_s`` for a call to finish, hand it to its handler, and carry
        out what the fault policy decides about any failure found; the one place the loop
        waits for its actors, so the stall watch looks after every wait.

        Raises:
            ActorFailedError: The policy stopped the run (see `FaultPolicy.decide`).
            TrainerDiedError: A trainer died (`run` restarts from a checkpoint).
            RunStalledError: No step trained for ``stall_timeout_s`` and replacing an actor
                cannot help (`StallWatch.diagnose`); the message names the actor.
        """
        ready, _ = ray.wait(list(self.scheduler.calls), num_returns=1, timeout=timeout_s)
        if self.stall_watch.due():
            calls, heartbeats = self.scheduler.stalled_calls()
            lag, recovering = self.cfg.orchestration.max_policy_lag, bool(self.actors.recovering)
            # A replacement's first samples carry the weights it started from until it caught
            # up: drops as stale then say nothing about the lag.
            stall = self.stall_watch.look(
                calls, heartbeats, self.scheduler.buffer_stats, lag, recovering
            )
            if stall is not None and not stall.replaceable:
                raise RunStalledError(stall.reason)
            if stall is not None:  # killed, its call in flight fails and is carried out
                stalls = {"faults/stalls": float(self.stall_watch.stalls)}
                self.actors.log_metrics(stalls, self.state.step)
                self.actors.kill(stall.actor, stall.reason)
        self.scheduler.finish(ready, relaunch)
        self._handle_failures()

    def _handle_failures(self) -> None:
        """Do what the fault policy decides about each failure found: a call that failed
        (the scheduler's), or a collector that could not receive weights (the weight sync's;
        killed first).

        Replace: start a new actor (unless an earlier failure of the same one did), catch it
        up (`_catch_up`), and redo the failed call. Restart: end the step with
        `TrainerDiedError` (`run` restarts). Stop: raise the policy's error.
        """
        while self.scheduler.failed or self.weights.failed:
            if self.scheduler.failed:
                failed = self.scheduler.failed.pop(0)
            else:
                index, collector, error = self.weights.failed.pop(0)
                name = actor_name(Role.INFERENCE, index)
                if collector is self.actors.actor(Role.INFERENCE, index):
                    self.actors.kill(name, str(error))
                failed = Failed(Failure(name, error), Role.INFERENCE, index, collector)
            failure = failed.failure
            if failed.actor is not self.actors.actor(failed.role, failed.index):
                failure = dataclasses.replace(failure, current=False)
            decision = self.faults.decide(failure)
            if isinstance(decision, Stop):
                raise decision.error from failure.error
            if isinstance(decision, Restart):
                raise TrainerDiedError(decision.reason) from failure.error
            assert isinstance(decision, Replace)
            self._stopping = self._stopping or decision.last
            role, index = failed.role, failed.index
            recovery = None
            if failure.current:
                recovery = self.actors.replace(role, index, failed.actor, failure.error)
            if recovery is not None:
                try:
                    self._catch_up(role, index, failed.actor)
                finally:
                    self.actors.record_recovery(recovery)
            if failed.call is not None:
                if failed.call.kind is CallKind.GENERATE:
                    # What the dead call had queued comes again from the redo: skipped once.
                    self.inflight.collector_replaced(index, failed.call.group_ids)
                self.scheduler.redo[failed.call.kind](failed.call)

    def _catch_up(self, role: Role, index: int, dead: Any) -> None:
        """What a replacement needs before it works.

        - A collector: the state of the old one's last finished batch, and the current weights.
        - A replay buffer or rollout queue: the groups the dead one held are generated again
          under their ids, without the trajectories trained on already (`InFlightLedger`);
          scored batches the buffer had not taken go to the new one. Logs
          ``faults/groups_rescued`` (queue) or ``faults/buffer_groups_rescued`` (buffer).
        - A reference actor: nothing (its call is redone).
        """
        new = self.actors.actor(role, index)
        if role is Role.INFERENCE:
            state = self.actors.collector_states[index]
            self.weights.catch_up(new, state, actor_name(role, index), index)
        elif role is Role.REPLAY_BUFFER:
            lost = self.inflight.lost_in_buffer()
            self.scheduler.pump_buffer_adds()
            self.actors.log_metrics(
                {"faults/buffer_groups_rescued": float(len(lost))}, self.state.step
            )
        elif role is Role.ROLLOUT_QUEUE:
            rescued = self.scheduler.queue_replaced(dead)
            self.actors.log_metrics({"faults/groups_rescued": float(rescued)}, self.state.step)

    def _ask(self, role: Role, index: int, method: str, *args: Any) -> Any:
        """Call ``method`` of a replaceable actor and wait; a dead one is replaced and asked.

        For the calls the loop makes between steps, which find an actor that died while it
        had nothing to do.
        """
        while True:
            actor = self.actors.actor(role, index)
            try:
                return ray.get(getattr(actor, method).remote(*args))
            except (RayActorError, RayTaskError) as error:
                died = isinstance(error, RayActorError)
                failure = Failure(actor_name(role, index), error, died)
                self.scheduler.failed.append(Failed(failure, role, index, actor))
                self._handle_failures()

    def _drain(self, held: list[Any] | None = None) -> None:
        """Let every call in flight finish, launching no new generation or queue take.

        Scoring and buffer adds of what is already taken still run. If ``held`` is given the
        queue is emptied into it meanwhile, which lets a collector blocked on a full queue
        finish its batch.
        """
        while self.scheduler.calls:
            if held is not None:
                self.scheduler.empty_queue_into(held)
            self._poll(0.2, relaunch=False)
        if held is not None:
            self.scheduler.empty_queue_into(held)
            self._handle_failures()

    def _sleep_collectors(self) -> None:
        """Put every collector's engine to sleep before the trainers step: they share the GPU
        (``inference.sleep_while_training``). Each wakes for its next batch or weight check,
        loads the weights synced meanwhile and probes them (`grpo.workers.engine_sleep`).
        A collector that died between batches is replaced (its replacement starts awake, and
        sleeps too).
        """
        calls = [(c, c.sleep_engine.remote()) for c in self.collectors]
        for index, (collector, ref) in enumerate(calls):
            try:
                metrics = ray.get(ref)
            except RayActorError:
                metrics = self._ask(Role.INFERENCE, index, "sleep_engine")  # replaced first
            except RayTaskError as error:
                failure = Failure(actor_name(Role.INFERENCE, index), error, died=False)
                self.scheduler.failed.append(Failed(failure, Role.INFERENCE, index, collector))
                self._handle_failures()  # a Stop
            # The sleep and wake that ended with this step's generation.
            self.actors.log_metrics(metrics, self.state.step)

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
            ActorFailedError: The actors could not be started again (a lost node was the last
                that fit a role).
        """
        log.warning("%s; restarting the run from its latest checkpoint", error)
        # Named after rank 0, whose first finished step ends the recovery (`returned`).
        recovery = Recovery(actor_name(Role.TRAINING, 0), self.state.step, 0.0, str(error))
        died_at = self.state.step
        saved_one = (self.run_dir / CHECKPOINTS_DIR / LATEST_FILE).is_file()
        checkpoint = find_checkpoint(self.run_dir, True) if saved_one else self.start_checkpoint
        for attempt in range(1, _RESTART_ATTEMPTS + 1):
            # The driver's in-flight state starts empty, and a new weight sync (the run's count
            # of retries goes on).
            self.scheduler.reset(InFlightLedger(self.cfg.orchestration.num_inference_workers))
            self.checkpointer.pipeline = [self.actors, self.inflight]
            retries, self.weights = self.weights.retries, _weight_sync(self.cfg, self.actors)
            self.weights.retries = retries
            try:
                self.actors.restart_pipeline(self._pad_token_id, checkpoint)
                if checkpoint is not None:
                    self.checkpointer.load(checkpoint)
                break
            except ActorFailedError as failure:
                # A new actor placed on a node that was dying (Ray marks a lost node dead
                # some seconds after its processes die) dies too: start them all again.
                if attempt == _RESTART_ATTEMPTS:
                    raise
                log.warning("restart attempt %d failed (%s); trying again", attempt, failure)
                time.sleep(2.0 * attempt)
        if checkpoint is None:
            self.state.step = self.state.policy_version = 0
            self.state.eval_history = [e for e in self.state.eval_history if e[0] == 0]
        self.checkpointed_step = self.state.step if checkpoint is not None else None
        self.synced_step = self.state.step
        self.steps_redone += died_at - self.state.step
        self.run_ledger.rewound(self.state.step, died_at)
        logger = self.actors.metric_logger
        if logger is not None and hasattr(logger, "rewound"):  # a custom logger may lack it
            # After every record of the lost steps, before any of the redone ones: what they
            # logged first is superseded (`MetricLogger.rewound`).
            logger.rewound.remote(self.state.step, died_at)
        self.actors.record_recovery(recovery)
        self.actors.log_metrics({FAULTS_STEPS_REDONE: float(self.steps_redone)}, self.state.step)
        log.warning(
            "restarted from %s at step %d (%d steps to redo)",
            checkpoint or "the start",
            self.state.step,
            died_at - self.state.step,
        )

    # ------------------------------------------------------------------ checkpoints, the end

    def save_checkpoint(self) -> Path:
        """Save everything a run needs to continue exactly, atomically.

        Steps trained since the last weight sync are published first, so the checkpoint's
        weights are the policy version it records. The pipeline is quiesced: collectors finish
        their batch (the queue is emptied meanwhile so none stays blocked) and reference
        actors finish scoring. Groups taken from the queue and scored groups still waiting
        for room in the buffer go into the checkpoint, and stay with the driver to be scored
        and added as before. A reference actor or buffer that died between calls is replaced
        first (a buffer is refilled from the driver's references).

        Returns:
            Path: The checkpoint folder ``run_dir/checkpoints/step_NNNNNN``.
        """
        start = time.perf_counter()
        if self.synced_step != self.state.step:
            # A checkpoint is a weight sync: its weights then are a version the collectors
            # received, and a run resumed from it labels what it samples with that version.
            self._sync_weights()
        # Idle actors that died are replaced before the drain: what a new buffer is sent (the
        # scored batches waiting for it) is then added, and recorded, before its state is read.
        for index in range(len(self.ref_actors)):
            self._ask(Role.REF, index, "__ray_ready__")
        self._ask(Role.REPLAY_BUFFER, 0, "__ray_ready__")
        held: list[Any] = []
        self._drain(held=held)
        if held:
            self.inflight.unscored.append(ray.put(held))
            self.inflight.taken([group.group_id for group in held])
        final = self.checkpointer.save(self.state.step)
        self.checkpointed_step = self.state.step
        self._saved_at = time.monotonic()
        self.actors.log_metrics(
            {"checkpoint/time (s)": time.perf_counter() - start}, self.state.step
        )
        log.info("saved checkpoint %s", final)
        return final

    def verify_weight_sync(self) -> bool:
        """Check that every collector computes with exactly the trainer's current weights.

        Pending weights are applied first. Logs ``weight_sync/in_sync`` (1 or 0).

        Returns:
            bool: True if every collector's checksum equals the trainer's.
        """
        in_sync = self.weights.verify(self.trainers, self.collectors)
        while self.weights.failed:  # replaced while settling: check with its replacement
            self._handle_failures()
            in_sync = self.weights.verify(self.trainers, self.collectors)
        self.actors.log_metrics({"weight_sync/in_sync": float(in_sync)}, self.state.step)
        return in_sync

    def save_final_checkpoint(self) -> Path:
        """Save the policy as an HF-format folder ``run_dir/final``."""
        out_dir = self.run_dir / "final"
        self.actors.save_trainers(out_dir, hf=True)
        return out_dir

    def shutdown(self) -> None:
        """End every actor of the run (idempotent)."""
        self.run_ledger.close()
        self.actors.shutdown()
