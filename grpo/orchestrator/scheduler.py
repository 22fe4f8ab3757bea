"""Scheduling: one call in flight per actor, and what each finished call leads to.

Collectors generate onto the rollout queue (or generate again what a dead queue or buffer
lost), reference slots take groups from it and score them, scored batches go to the replay
buffer one add at a time, a sample call waits in the buffer for a batch, and the trainers step
on it. Each kind of call has one handler
(`Scheduler.handlers`) and one way to be redone on a replacement actor (`Scheduler.redo`).

The scheduler decides nothing about faults: a call that failed comes back from `finish` as a
`Failed` event, and so does a dead rollout queue it finds on the way; the loop asks the fault
policy what to do (`grpo.orchestrator.faults`) and carries it out.

The driver never fetches trajectories: the buffer's ``sample_batch`` waits inside the buffer
until a batch is there and returns it as its own object, which goes to the trainers as a
reference, next to a small summary (ids, buffer stats) that the ledger and metrics read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from grpo.config import RunConfig
from grpo.observability.metric_names import (
    INFERENCE_GROUPS_NOT_QUEUED,
    INFERENCE_TIME_GENERATION,
    REF_PERF_NAMESPACE,
    REF_PERF_TIME_WAITING_BUFFER,
    REF_PERF_TOTAL_ROLLOUT_TIME,
    ratio_metrics,
)
from grpo.observability.metrics import RunLedger
from grpo.orchestrator.episode_drops import EpisodeDrops
from grpo.orchestrator.faults import Failure
from grpo.orchestrator.group_counts import GroupCounts
from grpo.orchestrator.ledger import InFlightLedger
from grpo.orchestrator.reward_failures import RewardFailures
from grpo.orchestrator.stall import CallInFlight
from grpo.orchestrator.state import Call, CallKind, RunState
from grpo.orchestrator.supervisor import ActorSupervisor, Role, actor_name, actor_started
from grpo.weights.concurrency import COLLECTOR_HEALTH_GROUP
from grpo.weights.sync import HEARTBEAT_TIMEOUT_S, START_UP_LIMIT_S

# Most seconds one sample call waits inside the buffer for a batch before it returns empty and
# is asked again. Short enough that a buffer that died or a stop is noticed soon.
_SAMPLE_WAIT_S = 5.0


# Calls whose result describes the state of the actor that ran them: read after that actor
# was replaced, they would describe a state that is gone.
_UNDONE_BY_REPLACEMENT = (CallKind.ADD, CallKind.SAMPLE)


@dataclass(frozen=True)
class SampledBatch:
    """A batch the buffer sampled: its reference (for the trainers) and its summary (ids,
    buffer stats: all the driver reads)."""

    ref: Any
    summary: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A dead or failing actor found by the scheduler: the failure for the fault policy, the
    handle that failed (a replacement is started only if it is still the current one), and
    the call to redo on the replacement (None: nothing to redo)."""

    failure: Failure
    role: Role
    index: int
    actor: Any
    call: Call | None = None


@dataclass
class Busy:
    """Seconds collectors generated and reference actors scored in calls that finished during
    the current step (they run beside training, so they overlap its wall time)."""

    generation: float = 0.0
    scoring: float = 0.0


@dataclass
class Scheduler:
    """The calls in flight and the handlers of their results.

    Args:
        cfg (RunConfig): The run config.
        actors (ActorSupervisor): The current actor handles.
        inflight (InFlightLedger): What the driver holds between actors (a new one after a
            restart: `reset`).
        state (RunState): The run's step (metrics are logged at it).
        run_ledger (RunLedger): Records scored and trained trajectories.
        log (Callable): ``log(metrics, step)``.
        episode_drops, reward_failures, group_counts: The data guards the handlers feed.
    """

    cfg: RunConfig
    actors: ActorSupervisor
    inflight: InFlightLedger
    state: RunState
    run_ledger: RunLedger
    log: Callable[[dict[str, float], int], None]
    episode_drops: EpisodeDrops
    reward_failures: RewardFailures
    group_counts: GroupCounts
    calls: dict[Any, Call] = field(default_factory=dict)
    # Failures found since the loop last looked (`finish`, a dead rollout queue on the way).
    failed: list[Failed] = field(default_factory=list)
    # The batch the last sample call returned, until the loop trains on it.
    batch: SampledBatch | None = None
    train_results: dict[int, dict[str, Any]] = field(default_factory=dict)  # by rank
    busy: Busy = field(default_factory=Busy)
    buffer_stats: dict[str, float] = field(default_factory=dict)
    # Ids of actors that answered a call: started up (the stall watch waits for the others).
    answered: set[str] = field(default_factory=set)
    _idle_ref_slots: set[int] = field(default_factory=set)
    # Batches that came back from a queue that died, before its takes all came back.
    lost_batches: list[list[Any]] = field(default_factory=list)
    # Per reference slot: when it started waiting for groups, and how long it waited.
    _waiting_since: dict[int, float] = field(default_factory=dict)
    _waited: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.handlers: dict[CallKind, Callable[[Call, Any, bool], None]] = {
            CallKind.GENERATE: self._on_generated,
            CallKind.TAKE: self._on_taken,
            CallKind.SCORE: self._on_scored,
            CallKind.ADD: self._on_added,
            CallKind.SAMPLE: self._on_sampled,
            CallKind.TRAIN: self._on_trained,
        }
        # A dead trainer restarts the run from a checkpoint: its calls are never redone.
        self.redo: dict[CallKind, Callable[[Call], None]] = {
            CallKind.GENERATE: lambda call: self.launch_collector(call.index, call.records),
            CallKind.TAKE: lambda call: self.feed_ref_slot(call.index),
            CallKind.SCORE: lambda call: self._launch_score(call.index, call.groups_ref),
            CallKind.ADD: lambda call: self.pump_buffer_adds(),
            CallKind.SAMPLE: lambda call: self.launch_sample(),
        }

    def reset(self, inflight: InFlightLedger) -> None:
        """Forget every call in flight (their actors were ended) and hold ``inflight``."""
        self.inflight = inflight
        self.calls.clear()
        self.failed.clear()
        self.batch, self.train_results = None, {}
        self.buffer_stats, self.answered = {}, set()
        self._idle_ref_slots.clear()
        self.lost_batches.clear()
        self._waiting_since.clear()
        self._waited.clear()

    # ------------------------------------------------------------------ launching calls

    def in_flight(self, kind: CallKind) -> bool:
        return any(call.kind is kind for call in self.calls.values())

    def launch_collector(self, index: int, records: list[Any] | None = None) -> None:
        """The collector's next batch; first the lost groups it was given to generate again
        (``records``: redo a call that generated them)."""
        actor, queue = self.actors.collectors[index], self.actors.rollout_queue
        records = records or self.inflight.to_regenerate.pop(index, None)
        if records:
            ref = actor.regenerate.remote(records, queue)
            group_ids = [record.group_id for record in records]
        else:
            batch_size = self.cfg.inference.batch_size
            ref = actor.generate_batch_with_state.remote(batch_size, queue)
            state = self.actors.collector_states[index] or {}
            counter, workers = state.get("group_counter", 0), len(self.actors.collectors)
            group_ids = [index + workers * (counter + i) for i in range(batch_size)]
        self.calls[ref] = Call(
            CallKind.GENERATE, index, actor, queue=queue, group_ids=group_ids, records=records
        )

    def _launch_score(self, index: int, groups_ref: Any) -> None:
        now = time.perf_counter()
        self._waited[index] = now - self._waiting_since.pop(index, now)
        actor = self.actors.ref_actors[index]
        info_ref, scored_ref = actor.score.options(num_returns=2).remote(groups_ref)
        self.calls[info_ref] = Call(
            CallKind.SCORE, index, actor, groups_ref=groups_ref, scored_ref=scored_ref
        )

    def feed_ref_slot(self, index: int) -> None:
        """Give reference actor ``index`` work: waiting groups first, then the queue.

        While more scored batches wait for room in the buffer than there are reference
        actors, the slot stays idle: back-pressure reaches the queue, then the collectors.
        """
        self._idle_ref_slots.discard(index)
        self._waiting_since.setdefault(index, time.perf_counter())
        if self.inflight.unscored:
            self._launch_score(index, self.inflight.unscored.popleft())
        elif len(self.inflight.to_buffer) > len(self.actors.ref_actors):
            self._idle_ref_slots.add(index)
        else:
            queue = self.actors.rollout_queue
            timeout_s = 0.0 if self.cfg.orchestration.synchronous else 0.5
            ids_ref, groups_ref = queue.take(self.groups_per_ref_call(), timeout_s)
            self.calls[ids_ref] = Call(CallKind.TAKE, index, queue, groups_ref=groups_ref)

    def groups_per_ref_call(self) -> int:
        """Most groups one reference call takes: a collector's generation batch, shared among
        the reference actors. Each call costs a take, a score, an add and a log round trip
        whatever its size, and the actor packs what it takes into forwards of its token
        budget."""
        return math.ceil(self.cfg.inference.batch_size / len(self.actors.ref_actors))

    def launch_sample(self) -> None:
        """Ask the buffer for a batch; it answers once it has one (or after a while, empty).

        A synchronous run looks once: nothing is generated while it waits.
        """
        actor = self.actors.replay_buffer
        timeout_s = 0.0 if self.cfg.orchestration.synchronous else _SAMPLE_WAIT_S
        # The trainers' weights are the policy version of ``state.step`` (a version counts
        # training steps), synced to the collectors or not: staleness is counted from it.
        summary_ref, batch_ref = actor.sample_batch.options(num_returns=2).remote(
            self.cfg.training.batch_size, self.state.step, timeout_s
        )
        # The driver reads only the summary; the trainers read the batch.
        self.calls[summary_ref] = Call(CallKind.SAMPLE, 0, actor, batch_ref=batch_ref)

    def launch_train(self, batch: SampledBatch, waited: float, debug_ids: Any) -> None:
        """Every rank trains on the whole batch's reference (one object in the store, read by
        every rank), each on its own share of it (`PyTorchActorModel.train_step`)."""
        self.train_results = {}
        for rank, trainer in enumerate(self.actors.trainers):
            ref = trainer.train_step.remote(batch.ref, waited, debug_ids)
            self.calls[ref] = Call(CallKind.TRAIN, rank, trainer)

    def pump_buffer_adds(self) -> None:
        """Offer the oldest waiting scored batch to the buffer (one add in flight, in order)."""
        batch = self.inflight.next_to_add()
        if batch is None or self.in_flight(CallKind.ADD):
            return
        actor = self.actors.replay_buffer
        ref = actor.add_groups.remote(batch.groups_ref, batch.added, batch.skip)
        self.calls[ref] = Call(CallKind.ADD, 0, actor, scored=batch)

    # ------------------------------------------------------------------ results

    def finish(self, ready: list[Any], relaunch: bool) -> None:
        """Hand each finished call to its handler; ``relaunch`` keeps the pipeline busy.

        A call that failed goes to ``failed`` for the loop to decide on.
        """
        for ref in ready:
            call = self.calls.pop(ref)
            role = call.kind.role
            try:
                result = ray.get(ref)
            except (RayActorError, RayTaskError) as error:
                died = isinstance(error, RayActorError)
                init_failed = died and bool(error.actor_init_failed)
                failure = Failure(actor_name(role, call.index), error, died, init_failed)
                self.failed.append(Failed(failure, role, call.index, call.actor, call))
                continue
            if call.kind in _UNDONE_BY_REPLACEMENT and call.actor is not self.actors.actor(role):
                # It finished on a buffer that was replaced before this result was read: the
                # groups it added or sampled went with that buffer, and the ledger generates
                # them again (`InFlightLedger.lost_in_buffer`). Read as done, an add would
                # count groups the new buffer lacks (lost) and a sample would train groups
                # that come again (trained twice): redone on the new buffer instead.
                error = RuntimeError(f"finished on a {role.value} that was replaced since")
                failure = Failure(actor_name(role, call.index), error, current=False)
                self.failed.append(Failed(failure, role, call.index, call.actor, call))
                continue
            self.actors.returned(role, call.index, call.actor)
            self.answered.add(call.actor_id)
            self.handlers[call.kind](call, result, relaunch)

    def _on_generated(self, call: Call, result: Any, relaunch: bool) -> None:
        self.log(result["metrics"], self.state.step)
        self.episode_drops.batch(call.index, result.get("dropped_episodes"))
        self.reward_failures.batch(call.index, result.get("reward_calls"))
        self.reward_failures.check()
        self.busy.generation += result["metrics"].get(INFERENCE_TIME_GENERATION, 0.0)
        self.actors.collector_states[call.index] = result["state"]
        if (collector := self.actors.collectors[call.index]) is not call.actor:
            # The batch finished just before its collector was killed (a weight transfer
            # failed, a stall was named): the replacement was caught up to the batch before
            # this one and would generate this one's groups again under the same ids, to be
            # trained twice. It goes on from here instead (Ray runs one caller's calls in
            # order: before the next batch this loop launches on it).
            collector.load_state_dict.remote(result["state"])
        queue, records = call.queue, result["records"]
        if (
            result["metrics"].get(INFERENCE_GROUPS_NOT_QUEUED)
            and queue is self.actors.rollout_queue
        ):
            # The collector found the queue dead before the loop did.
            name = actor_name(Role.INFERENCE, call.index)
            self._queue_died(queue, RuntimeError(f"{name} could not put groups on it"))
        self.inflight.generated(call.index, records)
        # A batch that began before the queue was replaced may have lost groups with it:
        # those no take reached, known once every take from that queue came back.
        if any(f.role is Role.ROLLOUT_QUEUE and f.actor is queue for f in self.failed):
            self.lost_batches.append(records)
        elif queue is not self.actors.rollout_queue:
            self.inflight.lost_with_batch(records)
        if relaunch:
            self.launch_collector(call.index)

    def _on_taken(self, call: Call, result: Any, relaunch: bool) -> None:
        if result:
            self.inflight.taken(result)
            self._launch_score(call.index, call.groups_ref)
        elif relaunch:
            self.feed_ref_slot(call.index)

    def _on_scored(self, call: Call, result: Any, relaunch: bool) -> None:
        step = self.state.step
        waited = self._waited.pop(call.index, 0.0)
        busy = result["metrics"][REF_PERF_TOTAL_ROLLOUT_TIME]
        self.state.last_scored_metrics = result["metrics"]
        self.busy.scoring += busy
        metrics = {
            **result["metrics"],
            REF_PERF_TIME_WAITING_BUFFER: waited,
            **ratio_metrics(
                REF_PERF_NAMESPACE, {REF_PERF_TIME_WAITING_BUFFER: waited}, waited + busy
            ),
        }
        self.log(metrics, step)
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
        self.inflight.scored(call.scored_ref, result)
        self.pump_buffer_adds()
        if relaunch:
            self.feed_ref_slot(call.index)

    def _on_added(self, call: Call, result: Any, relaunch: bool) -> None:
        self.inflight.added(call.scored, result)
        self.pump_buffer_adds()
        if relaunch:
            for index in sorted(self._idle_ref_slots):
                if len(self.inflight.to_buffer) <= len(self.actors.ref_actors):
                    self.feed_ref_slot(index)

    def _on_sampled(self, call: Call, summary: dict[str, Any], relaunch: bool) -> None:
        self.buffer_stats = summary["stats"]
        if summary["sequence_ids"] is None:
            stats = summary["stats"]
            if self.inflight.buffer_full and stats["size"] < stats["capacity"]:
                # Stale trajectories were dropped: there is room for the adds that waited.
                self.inflight.buffer_full = False
                self.pump_buffer_adds()
            if relaunch:
                self.launch_sample()  # it waited in the buffer already: no back-off here
        else:
            self.inflight.sampled(summary["sequence_ids"], summary["group_ids"])
            self.pump_buffer_adds()
            self.batch = SampledBatch(call.batch_ref, summary)

    def _on_trained(self, call: Call, result: Any, relaunch: bool) -> None:
        self.train_results[call.index] = result

    # ------------------------------------------------------------------ the rollout queue

    def queue_size(self) -> int:
        """Groups in the rollout queue; a dead queue is reported (the new one holds none)."""
        queue = self.actors.rollout_queue
        try:
            return queue.qsize()
        except RayActorError as error:
            self._queue_died(queue, error)
            return 0

    def empty_queue_into(self, held: list[Any]) -> None:
        """Move what the rollout queue holds into ``held`` (a dead queue is reported)."""
        queue = self.actors.rollout_queue
        try:
            if count := queue.qsize():
                held.extend(queue.get_nowait_batch(count))
        except RayActorError as error:
            self._queue_died(queue, error)

    def queue_replaced(self, dead_queue: Any) -> int:
        """After the rollout queue was replaced: once every take from the dead one came back,
        the groups it held (and those of batches that came back meanwhile) are generated
        again.

        Returns:
            int: How many groups are generated again.
        """
        takes = [
            r for r, c in self.calls.items() if c.kind is CallKind.TAKE and c.actor is dead_queue
        ]
        if takes:
            done, _ = ray.wait(takes, num_returns=len(takes), timeout=_SAMPLE_WAIT_S)
            self.finish(done, relaunch=True)
        lost = self.inflight.lost_in_queue()
        for records in self.lost_batches:
            lost += self.inflight.lost_with_batch(records)
        self.lost_batches.clear()
        return len(lost)

    def _queue_died(self, queue: Any, error: Exception) -> None:
        failure = Failure(actor_name(Role.ROLLOUT_QUEUE), error)
        self.failed.append(Failed(failure, Role.ROLLOUT_QUEUE, 0, queue))

    # ------------------------------------------------------------------ the stall watch

    def stalled_calls(self) -> tuple[list[CallInFlight], dict[str, dict[str, Any] | None]]:
        """What the stall watch needs: the calls in flight of actors that started up (not
        collectors' generation calls), and each generating collector's heartbeat (None: it
        did not answer in time, and has started up)."""
        # Calls that finished but were not handed to their handler yet are not stuck.
        finished = set(ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)[0])
        now = time.monotonic()

        # An actor that has not answered once yet is starting up (a vLLM engine loading a
        # large model takes minutes): its silence is not a stall until it took too long.
        def started_up(call: Call) -> bool:
            if call.actor_id in self.answered or now - call.started > START_UP_LIMIT_S:
                return True
            if actor_started(call.actor):
                self.answered.add(call.actor_id)
                return True
            return False

        pending = [call for ref, call in self.calls.items() if ref not in finished]
        generating = {
            actor_name(Role.INFERENCE, c.index): c for c in pending if c.kind is CallKind.GENERATE
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
                self.answered.add(generating[name].actor_id)
            except (ray.exceptions.GetTimeoutError, RayActorError):
                if started_up(generating[name]):
                    heartbeats[name] = None  # frozen, or dead (replaced when its call fails)
        calls = [
            CallInFlight(c.kind.name, actor_name(c.kind.role, c.index), c.started)
            for c in pending
            if c.kind is not CallKind.GENERATE and started_up(c)
        ]
        return calls, heartbeats
