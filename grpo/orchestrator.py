"""Starts the actors of a run, drives them, and shuts them down.

The driver keeps exactly one call in flight per actor and reacts to whichever finishes
first (`ray.wait`), so generation, reference scoring and training overlap, and a dead actor
surfaces at once instead of as a hang. Data between actors moves as ObjectRefs the driver
owns and never fetches: groups taken from the rollout queue go to a reference actor, its
scored groups to the replay buffer, the buffer's sample to every trainer (each takes its
share). Holding those references is what lets the driver replace a dead collector,
reference actor or buffer and redo its work with nothing lost (see `Orchestrator`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf
from ray.exceptions import RayActorError, RayTaskError

from grpo.workers.rollout_queue import RolloutQueue

log = logging.getLogger("grpo")

# Most groups one reference call scores (they are packed together for the forward).
_GROUPS_PER_REF_CALL = 4


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


class TrainingDivergedError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient norm."""


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` to disk before it is renamed into place."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())


def find_checkpoint(run_dir: Path, resume: bool | str) -> Path | None:
    """The checkpoint to resume from: ``true`` means the latest in ``run_dir``.

    Raises:
        FileNotFoundError: If ``resume`` is true and ``run_dir`` has no checkpoint.
    """
    if resume is False or resume is None:
        return None
    if resume is True:
        latest = run_dir / "checkpoints" / "latest"
        if not latest.is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint=true but {latest} does not exist (no checkpoint saved "
                "in this output_dir yet)"
            )
        return run_dir / "checkpoints" / latest.read_text().strip()
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} is not a checkpoint folder")
    return path


def to_container(node: Any) -> Any:
    """Plain Python containers from an OmegaConf node (interpolations resolved)."""
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def init_ray(cfg: DictConfig) -> None:
    """Start a local Ray cluster, or join one when ``ray.address`` is set."""
    if ray.is_initialized():
        return
    ray_cfg = cfg.get("ray") or {}
    address = ray_cfg.get("address")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        if ray_cfg.get("num_cpus") is not None:
            kwargs["num_cpus"] = ray_cfg["num_cpus"]
        if ray_cfg.get("num_gpus") is not None:
            kwargs["num_gpus"] = ray_cfg["num_gpus"]
    ray.init(**kwargs)


def _resources(node: Any, default_cpus: float) -> dict[str, float]:
    num_cpus = node.get("num_cpus") if node is not None else None
    num_gpus = node.get("num_gpus") if node is not None else None
    return {
        "num_cpus": default_cpus if num_cpus is None else num_cpus,
        "num_gpus": num_gpus or 0,
    }


@dataclass
class RunState:
    """What the driver tracks while a run goes."""

    step: int = 0
    policy_version: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_history: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Recovery:
    """One dead actor that was replaced.

    ``seconds`` is what the driver spent replacing it (blocking the loop); ``seconds_to_work``
    runs until the replacement's first call came back (its start-up included), None until it
    has.
    """

    actor: str
    step: int
    seconds: float
    error: str
    started: float = field(default_factory=time.perf_counter, repr=False)
    seconds_to_work: float | None = None


@dataclass
class _Call:
    """A call in flight: what kind, on which actor, and what the driver needs if it fails."""

    kind: str  # collector | take | ref | add | sample | train
    index: int
    actor: Any
    payload: Any = None  # take: groups ref; ref: (groups ref, scored ref); add: ScoredBatch


@dataclass(eq=False)  # identity: the driver keys and deduplicates batches by object
class ScoredBatch:
    """Scored groups one reference call returned. The driver owns them until they are trained.

    The buffer holds its own copy; the driver keeps the reference (not the data, which stays
    in the object store) so that a replacement buffer can be rebuilt from it.
    """

    groups_ref: Any
    sequence_ids: list[list[str]]
    policy_version: int
    skip: set[str] = field(default_factory=set)  # duplicates, and trajectories sampled since
    added: int = 0  # groups the buffer has taken so far

    @property
    def num_groups(self) -> int:
        return len(self.sequence_ids)

    @property
    def used_up(self) -> bool:
        return all(sid in self.skip for ids in self.sequence_ids for sid in ids)


class Orchestrator:
    """Owns the actors of one run, drives them, and replaces the ones that die.

    Data that moves between actors is owned by the driver (Ray's ownership: objects returned
    by a call belong to the caller), never fetched by it: groups taken from the rollout queue
    until they are scored, scored groups until they are trained on. A collector, reference
    actor or replay buffer that dies is therefore replaced and its work redone from what the
    driver holds, up to ``orchestration.max_actor_restarts`` times each. A trainer holds the
    policy and optimizer state, so its death stops the run.

    Args:
        cfg (DictConfig): The validated run config.
        run_dir (Path): Folder for logs and checkpoints.
        tokenizer: Decodes debug tables (optional).
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.ledger = RunLedger(self.run_dir)
        self.state = RunState()
        self.collectors: list[Any] = []
        self.ref_actors: list[Any] = []
        self.trainers: list[Any] = []
        self.replay_buffer = None
        self.rollout_queue = None
        self.metric_logger = None
        self.stop_requested = False
        self.recoveries: list[Recovery] = []
        self._recovering: dict[str, Recovery] = {}  # replaced, first call not back yet
        orchestration = cfg.orchestration
        self.synchronous = bool(orchestration.get("synchronous", False))
        self.max_actor_restarts = orchestration.get("max_actor_restarts", 3)
        self._inflight: dict[Any, _Call] = {}
        # What replacements are rebuilt from.
        self._collector_states: list[dict[str, Any] | None] = []
        self._collector_model_dir = cfg.base_model_path
        self._collector_start_version = 0
        self._last_weights: dict[str, Any] | None = None
        self._restarts: dict[str, int] = {}
        self._gave_up: ActorFailedError | None = None
        # Groups taken from the queue that wait for a reference actor (after a checkpoint).
        self._unscored: deque[Any] = deque()
        # Scored groups on their way into the buffer, and those in it not yet sampled.
        self._to_buffer: deque[ScoredBatch] = deque()
        self._in_buffer: dict[str, ScoredBatch] = {}
        self._seen_group_ids: set[int] = set()
        self._buffer_full = False
        self._idle_ref_slots: set[int] = set()
        # Per reference slot: when it started waiting for groups, and how long it waited.
        self._waiting_since: dict[int, float] = {}
        self._waited: dict[int, float] = {}
        self._sampled: tuple[Any, list[Any] | None] | None = None
        self._train_results: dict[int, dict[str, Any]] = {}  # by rank, for the current step
        self._poll_delay = 0.02
        self.num_duplicate_groups = 0

    # ------------------------------------------------------------------ start-up

    def start_metric_logger(self) -> Any:
        from grpo.workers.metric_logger import MetricLogger

        node = to_container(self.cfg.get("metric_logger")) or {}
        node.pop("_component_", None)
        node.setdefault("log_dir", str(self.run_dir))
        node.setdefault("config", to_container(self.cfg))
        self.metric_logger = ray.remote(num_cpus=0)(MetricLogger).remote(**node)
        return self.metric_logger

    def start_rollout_queue(self) -> RolloutQueue:
        self.rollout_queue = RolloutQueue(maxsize=self.cfg.inference.queue_maxsize)
        return self.rollout_queue

    def start_replay_buffer(self) -> Any:
        from grpo.workers.replay_buffer import ReplayBuffer

        orchestration = self.cfg.orchestration
        self.replay_buffer = ray.remote(num_cpus=0)(ReplayBuffer).remote(
            capacity=orchestration.replay_buffer_size,
            max_policy_lag=orchestration.max_policy_lag,
            seed=self.cfg.seed,
        )
        return self.replay_buffer

    def start_trainers(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> list[Any]:
        from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

        cfg, training = self.cfg, self.cfg.training
        world_size = cfg.orchestration.num_training_workers
        actor_cls = ray.remote(**_resources(training, default_cpus=1))(PyTorchActorModel)
        self.trainers = [
            actor_cls.remote(
                rank=rank,
                world_size=world_size,
                model_dir=cfg.base_model_path,
                num_steps=cfg.orchestration.num_steps,
                target_tokens_per_batch=cfg.target_tokens_per_batch,
                pad_token_id=pad_token_id,
                config=TrainingConfig.from_mapping(to_container(training)),
                seed=cfg.seed,
            )
            for rank in range(world_size)
        ]
        init_method = (
            ray.get(self.trainers[0].get_dist_address.remote()) if world_size > 1 else None
        )
        checkpoint = str(checkpoint_dir) if checkpoint_dir else None
        self._get_all(
            [t.setup.remote(init_method, checkpoint) for t in self.trainers], "trainer set-up"
        )
        return self.trainers

    def _new_ref_actor(self) -> Any:
        from grpo.workers.ref import RefActor, RefConfig

        cfg = self.cfg
        ref_cfg = cfg.get("ref") or {}
        return ray.remote(**_resources(ref_cfg, default_cpus=1))(RefActor).remote(
            model_dir=cfg.base_model_path,
            reward_functions=to_container(cfg.reward_functions),
            target_tokens_per_batch=cfg.target_tokens_per_batch,
            config=RefConfig.from_mapping(to_container(ref_cfg)),
        )

    def start_ref_actors(self) -> list[Any]:
        self.ref_actors = [
            self._new_ref_actor() for _ in range(self.cfg.orchestration.num_ref_workers)
        ]
        return self.ref_actors

    def _new_collector(self, worker_id: int) -> Any:
        from grpo.workers.collector import InferenceConfig, SyncLLMCollector

        cfg, inference = self.cfg, self.cfg.inference
        # Threaded actor (max_concurrency 4): evaluate and receive_weights must get through
        # while generate_batch waits on a full rollout queue, or evaluation deadlocks.
        actor_cls = SyncLLMCollector.as_remote(**_resources(inference, default_cpus=1))
        return actor_cls.remote(
            worker_id=worker_id,
            num_workers=cfg.orchestration.num_inference_workers,
            model_dir=str(self._collector_model_dir),
            dataset=to_container(cfg.dataset),
            rollout_queue=self.rollout_queue,
            config=InferenceConfig.from_mapping(to_container(inference)),
            seed=cfg.seed,
        )

    def start_collectors(self, weights_dir: Path | None = None) -> list[Any]:
        """Start the vLLM collectors from ``weights_dir`` (a checkpoint) or the base model."""
        if weights_dir is not None:
            self._collector_model_dir = str(weights_dir)
        num_workers = self.cfg.orchestration.num_inference_workers
        self.collectors = [self._new_collector(worker_id) for worker_id in range(num_workers)]
        self._collector_states = [None] * num_workers
        return self.collectors

    def start_actors(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> None:
        """Start every actor of the run in order, and restore ``checkpoint_dir`` if given.

        Args:
            pad_token_id (int): The tokenizer's pad id (for packing).
            checkpoint_dir (Path | None): A checkpoint to resume from (`find_checkpoint`).
        """
        self.start_metric_logger()
        self.start_rollout_queue()
        self.start_replay_buffer()
        self.start_trainers(pad_token_id=pad_token_id, checkpoint_dir=checkpoint_dir)
        self.start_ref_actors()
        self.start_collectors(weights_dir=checkpoint_dir / "model" if checkpoint_dir else None)
        if checkpoint_dir:
            self.restore(checkpoint_dir)

    # ------------------------------------------------------------------ helpers

    def _get_all(self, refs: list[Any], what: str = "") -> list[Any]:
        """``ray.get`` for calls the loop does not redo: a failure stops the run, named."""
        try:
            return ray.get(refs)
        except RayActorError as error:
            raise ActorFailedError(
                f"{what or 'an actor'} failed, an actor died ({error}): resume from "
                f"{self._latest_checkpoint_text()}"
            ) from error
        except RayTaskError as error:
            raise ActorFailedError(f"{what or 'an actor'} failed: {error}") from error

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.metric_logger is not None and metrics:
            self.metric_logger.log_dict.remote(metrics, step=step)

    @staticmethod
    def _actor_name(call: _Call) -> str:
        return {
            "collector": f"collector[{call.index}]",
            "take": "rollout_queue",
            "ref": f"ref_actor[{call.index}]",
            "add": "replay_buffer",
            "sample": "replay_buffer",
            "train": f"trainer[{call.index}]",
        }[call.kind]

    # ------------------------------------------------------------------ launching calls

    def request_stop(self) -> None:
        """Ask the loop to stop at the next step boundary (signal handlers call this)."""
        self.stop_requested = True

    def _launch_collector(self, index: int) -> None:
        actor = self.collectors[index]
        ref = actor.generate_batch_with_state.remote(self.cfg.inference.batch_size)
        self._inflight[ref] = _Call("collector", index, actor)

    def _launch_score(self, index: int, groups_ref: Any) -> None:
        now = time.perf_counter()
        self._waited[index] = now - self._waiting_since.pop(index, now)
        actor = self.ref_actors[index]
        info_ref, scored_ref = actor.score.options(num_returns=2).remote(groups_ref)
        self._inflight[info_ref] = _Call("ref", index, actor, (groups_ref, scored_ref))

    def _feed_ref_slot(self, index: int) -> None:
        """Give reference actor ``index`` work: waiting groups first, then the queue.

        While more scored batches wait for room in the buffer than there are reference
        actors, the slot stays idle: back-pressure reaches the queue, then the collectors.
        """
        self._idle_ref_slots.discard(index)
        self._waiting_since.setdefault(index, time.perf_counter())
        if self._unscored:
            self._launch_score(index, self._unscored.popleft())
        elif len(self._to_buffer) > len(self.ref_actors):
            self._idle_ref_slots.add(index)
        else:
            timeout_s = 0.0 if self.synchronous else 0.5
            count_ref, groups_ref = self.rollout_queue.take(_GROUPS_PER_REF_CALL, timeout_s)
            self._inflight[count_ref] = _Call("take", index, self.rollout_queue, groups_ref)

    def _launch_sample(self) -> None:
        actor = self.replay_buffer
        ref = actor.sample.remote(self.cfg.training.batch_size, self.state.policy_version)
        self._inflight[ref] = _Call("sample", 0, actor, payload=ref)  # trainers read it

    def _pump_buffer_adds(self) -> None:
        """Offer the oldest waiting scored batch to the buffer (one add in flight, in order)."""
        if not self._to_buffer or self._buffer_full:
            return
        if any(call.kind == "add" for call in self._inflight.values()):
            return
        batch, actor = self._to_buffer[0], self.replay_buffer
        ref = actor.add_groups.remote(batch.groups_ref, batch.added, batch.skip)
        self._inflight[ref] = _Call("add", 0, actor, batch)

    # ------------------------------------------------------------------ results

    def _result(self, ref: Any) -> tuple[_Call, Any] | None:
        """Pop a finished call: ``(call, result)``, or None if its actor died and was replaced.

        Raises:
            ActorFailedError: The actor raised, or died and cannot be replaced; the message
                names it.
        """
        call = self._inflight.pop(ref)
        try:
            result = ray.get(ref)
        except RayActorError as error:
            self._recover(call, error)
            return None
        except RayTaskError as error:
            raise ActorFailedError(f"{self._actor_name(call)} failed: {error}") from error
        name = self._actor_name(call)
        if name in self._recovering and call.actor is self._current_actor(call.kind, call.index):
            recovery = self._recovering.pop(name)  # the replacement's first result
            recovery.seconds_to_work = time.perf_counter() - recovery.started
            self._log({"faults/time_to_work_again (s)": recovery.seconds_to_work}, self.state.step)
        return call, result

    def _handle(self, call: _Call, result: Any, relaunch: bool) -> None:
        """React to a finished call; ``relaunch`` keeps collectors and the queue busy."""
        step = self.state.step
        if call.kind == "collector":
            self._log(result["metrics"], step)
            self._collector_states[call.index] = result["state"]
            if relaunch:
                self._launch_collector(call.index)
        elif call.kind == "take":
            if result:
                self._launch_score(call.index, call.payload)
            elif relaunch:
                self._feed_ref_slot(call.index)
        elif call.kind == "ref":
            waited = self._waited.pop(call.index, 0.0)
            busy = result["metrics"]["ref_actor_performance/total_rollout_time (s)"]
            metrics = {
                **result["metrics"],
                "ref_actor_performance/time_waiting_buffer (s)": waited,
                "ref_actor_performance/pct_time_waiting_buffer (%)": 100.0
                * waited
                / max(waited + busy, 1e-9),
            }
            self._log(metrics, step)
            self.ledger.scored(step, [sid for ids in result["sequence_ids"] for sid in ids])
            batch = ScoredBatch(call.payload[1], result["sequence_ids"], result["policy_version"])
            for group_id, ids in zip(result["group_ids"], result["sequence_ids"]):
                if group_id in self._seen_group_ids:  # regenerated by a replaced collector
                    batch.skip.update(ids)
                    self.num_duplicate_groups += 1
                self._seen_group_ids.add(group_id)
            self._to_buffer.append(batch)
            self._pump_buffer_adds()
            if relaunch:
                self._feed_ref_slot(call.index)
        elif call.kind == "add":
            batch = call.payload
            self._taken_by_buffer(batch, result)
            if batch.added == batch.num_groups:
                self._to_buffer.popleft()
            else:
                self._buffer_full = True  # retried after the next sample frees room
            self._pump_buffer_adds()
            if relaunch:
                self._wake_idle_ref_slots()
        elif call.kind == "sample":
            if result is None:
                if relaunch:
                    # Back off while the buffer fills: each poll is a Ray task.
                    time.sleep(self._poll_delay)
                    self._poll_delay = min(2 * self._poll_delay, 0.5)
                    self._launch_sample()
                else:
                    self._sampled = (None, None)
            else:
                self._poll_delay = 0.02
                self._mark_sampled(result)
                self._sampled = (call.payload, result)
        elif call.kind == "train":
            self._train_results[call.index] = result

    def _taken_by_buffer(self, batch: ScoredBatch, count: int) -> None:
        """The buffer took ``count`` more groups of ``batch``: hold them until sampled."""
        for ids in batch.sequence_ids[batch.added : batch.added + count]:
            for sid in ids:
                if sid not in batch.skip:
                    self._in_buffer[sid] = batch
        batch.added += count

    def _wake_idle_ref_slots(self) -> None:
        for index in sorted(self._idle_ref_slots):
            if len(self._to_buffer) <= len(self.ref_actors):
                self._feed_ref_slot(index)

    def _mark_sampled(self, trajectories: list[Any]) -> None:
        """Sampled trajectories leave the buffer: a rebuilt buffer must not get them again."""
        for trajectory in trajectories:
            batch = self._in_buffer.pop(trajectory.sequence_id, None)
            if batch is not None:
                batch.skip.add(trajectory.sequence_id)
        self._buffer_full = False
        self._pump_buffer_adds()

    def _forget_stale(self) -> None:
        """Stop holding scored batches the buffer drops as stale anyway."""
        oldest_allowed = self.state.policy_version - self.cfg.orchestration.max_policy_lag
        for sid in [s for s, b in self._in_buffer.items() if b.policy_version < oldest_allowed]:
            del self._in_buffer[sid]

    def _process(self, ready: list[Any], relaunch: bool) -> None:
        for ref in ready:
            outcome = self._result(ref)
            if outcome is not None:
                self._handle(*outcome, relaunch=relaunch)

    def _drain_inflight(self, held: list[Any] | None = None) -> None:
        """Let every call in flight finish, launching no new generation or queue take.

        Scoring and buffer adds of what is already taken still run. If ``held`` is given the
        queue is emptied into it meanwhile, which lets a collector blocked on a full queue
        finish its batch.
        """
        while self._inflight:
            if held is not None and self.rollout_queue.qsize():
                held.extend(self.rollout_queue.get_nowait_batch(self.rollout_queue.qsize()))
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=0.2)
            self._process(ready, relaunch=False)
        if held is not None and self.rollout_queue.qsize():
            held.extend(self.rollout_queue.get_nowait_batch(self.rollout_queue.qsize()))

    # ------------------------------------------------------------------ faults

    def _recover(self, call: _Call, error: Exception) -> None:
        """Replace the dead actor of ``call`` (unless already replaced) and redo the call.

        Raises:
            ActorFailedError: See `_replace`.
        """
        self._replace(call, error)
        if call.kind == "collector":
            self._launch_collector(call.index)
        elif call.kind == "ref":
            self._launch_score(call.index, call.payload[0])
        elif call.kind == "add":
            self._pump_buffer_adds()
        else:
            self._launch_sample()

    def _ask(self, kind: str, index: int, method: str, *args: Any) -> Any:
        """Call ``method`` of a replaceable actor and wait; a dead one is replaced and asked.

        For the calls the loop makes between steps (state for a checkpoint, buffer stats),
        which find an actor that died while it had nothing to do.
        """
        while True:
            actor = self._current_actor(kind, index)
            call = _Call(kind, index, actor)
            try:
                return ray.get(getattr(actor, method).remote(*args))
            except RayActorError as error:
                self._replace(call, error)
            except RayTaskError as error:
                raise ActorFailedError(f"{self._actor_name(call)} failed: {error}") from error

    def _current_actor(self, kind: str, index: int) -> Any:
        if kind == "collector":
            return self.collectors[index]
        if kind == "ref":
            return self.ref_actors[index]
        return self.replay_buffer  # add, sample

    def _replace(self, call: _Call, error: Exception) -> None:
        """Replace the dead actor of ``call``, unless an earlier failed call already did.

        Raises:
            ActorFailedError: For a trainer or the rollout queue, or an actor that has used up
                ``max_actor_restarts`` and died again while the run was stopping.
        """
        name = self._actor_name(call)
        if call.kind == "train":
            raise ActorFailedError(
                f"{name} died ({error}); trainers hold the policy and optimizer state and are "
                f"not restarted: resume from {self._latest_checkpoint_text()}"
            )
        if call.kind == "take":
            raise ActorFailedError(
                f"rollout_queue died ({error}); the groups in it are lost: resume from "
                f"{self._latest_checkpoint_text()}"
            )
        if call.actor is self._current_actor(call.kind, call.index):
            restarts = self._restarts.get(name, 0) + 1
            if restarts > self.max_actor_restarts:
                if self._gave_up is not None:
                    raise self._gave_up
                # Replace it once more so the pipeline can be checkpointed, then stop.
                self._gave_up = ActorFailedError(
                    f"{name} died {restarts} times (orchestration.max_actor_restarts="
                    f"{self.max_actor_restarts}); last error: {error}"
                )
            self._restarts[name] = restarts
            recovery = Recovery(name, self.state.step, 0.0, str(error))
            log.warning("%s died at step %d; replacing it: %s", name, self.state.step, error)
            if call.kind == "collector":
                self._replace_collector(call.index)
            elif call.kind == "ref":
                self.ref_actors[call.index] = self._new_ref_actor()
            else:
                self._replace_replay_buffer()
            recovery.seconds = time.perf_counter() - recovery.started
            self.recoveries.append(recovery)
            self._recovering[name] = recovery
            self._log(
                {
                    "faults/actor_restarts": float(len(self.recoveries)),
                    "faults/time_recovering (s)": recovery.seconds,
                },
                self.state.step,
            )

    def _replace_collector(self, index: int) -> None:
        """A new collector at the state of the old one's last finished batch, current weights."""
        collector = self.collectors[index] = self._new_collector(index)
        state = self._collector_states[index]
        if state is not None:
            # The replacement holds the weights it was started from; the latest ones follow.
            state = {**state, "policy_version": self._collector_start_version}
            self._get_all([collector.load_state_dict.remote(state)], f"collector[{index}] restart")
        if self._last_weights is not None:
            payload = self._last_weights
            collector.receive_weights.remote(
                payload["weights"], payload["version"], payload["checksum"], payload["probe"]
            )

    def _replace_replay_buffer(self) -> None:
        """A new buffer holding what the old one held: scored groups not yet sampled."""
        self.start_replay_buffer()
        self._buffer_full = False
        calls = []
        for batch in dict.fromkeys(self._in_buffer.values()):  # in order, once each
            # Leave out what was sampled and what the buffer had not taken yet.
            absent = {
                sid
                for ids in batch.sequence_ids
                for sid in ids
                if self._in_buffer.get(sid) is not batch
            }
            calls.append(self.replay_buffer.add_groups.remote(batch.groups_ref, 0, absent))
        self._get_all(calls, "replay_buffer rebuild")

    def _latest_checkpoint_text(self) -> str:
        latest = self.run_dir / "checkpoints" / "latest"
        if latest.is_file():
            return str(self.run_dir / "checkpoints" / latest.read_text().strip())
        return "the start (no checkpoint saved yet)"

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
            TrainingDivergedError: ``training.max_nonfinite_steps_in_a_row`` steps in a row
                were skipped for a non-finite loss (after saving a checkpoint).
        """
        cfg = self.cfg
        num_steps = cfg.orchestration.num_steps
        eval_every = cfg.get("eval_every_n_steps") or 0
        if evaluate is not None and self.state.step == 0:
            self.state.eval_history.append((0, evaluate(0)))

        while self.state.step < num_steps and not self.stop_requested:
            if self.synchronous:
                batch_ref, batch, waited = self._next_batch_synchronously()
            else:
                batch_ref, batch, waited = self._next_batch_asynchronously()
            if batch is None:
                break  # stop requested while waiting
            metrics = self._train(batch_ref, batch, waited)
            self._after_train_step(metrics, batch, cfg.training.steps_before_weight_sync)
            step = self.state.step
            if evaluate is not None and eval_every and step % eval_every == 0:
                self.state.eval_history.append((step, evaluate(step)))
            save_every = cfg.training.get("save_every_n_steps")
            if self._gave_up is not None:
                self.save_checkpoint()
                raise self._gave_up
            in_a_row = int(metrics.get("train_actor_training/nonfinite_steps_in_a_row", 0))
            if in_a_row >= cfg.training.get("max_nonfinite_steps_in_a_row", 3):
                saved = self.save_checkpoint()
                raise TrainingDivergedError(
                    f"{in_a_row} training steps in a row (up to step {step}) had a non-finite "
                    "loss or gradient norm and were skipped "
                    f"(training.max_nonfinite_steps_in_a_row="
                    f"{cfg.training.max_nonfinite_steps_in_a_row}); saved {saved}. Lower "
                    "training.optimizer.lr or check the rewards and the data."
                )
            if save_every and step % save_every == 0:
                self.save_checkpoint()
            if on_step is not None:
                on_step(self.state)

        done = self.state.step >= num_steps
        if evaluate is not None and done and (not eval_every or num_steps % eval_every):
            self.state.eval_history.append((num_steps, evaluate(num_steps)))
        return self.state

    def _next_batch_asynchronously(self) -> tuple[Any, list[Any] | None, float]:
        """Keep collectors and reference actors busy until the buffer yields a batch."""
        if not any(call.kind == "collector" for call in self._inflight.values()):
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            for index in range(len(self.ref_actors)):
                self._feed_ref_slot(index)
        stall_timeout_s = self.cfg.orchestration.get("stall_timeout_s", 600)
        wait_start = time.perf_counter()
        last_progress = time.monotonic()
        self._sampled = None
        self._launch_sample()
        while not self.stop_requested:
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=1.0)
            if not ready:
                if time.monotonic() - last_progress > stall_timeout_s:
                    busy = sorted({self._actor_name(c) for c in self._inflight.values()})
                    raise ActorFailedError(
                        f"no actor made progress for {stall_timeout_s:.0f} s (busy: {busy})"
                    )
                continue
            last_progress = time.monotonic()
            self._process(ready, relaunch=True)
            if self._sampled is not None:
                batch_ref, batch = self._sampled
                return batch_ref, batch, time.perf_counter() - wait_start
        return None, None, 0.0

    def _next_batch_synchronously(self) -> tuple[Any, list[Any] | None, float]:
        """Generate with the current weights and score everything, then sample a batch."""
        wait_start = time.perf_counter()
        while not self.stop_requested:
            self._sampled = None
            self._launch_sample()
            while self._sampled is None:
                self._drain_inflight()
            batch_ref, batch = self._sampled
            if batch is not None:
                return batch_ref, batch, time.perf_counter() - wait_start
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            self._drain_inflight()
            self._score_everything_queued()
        return None, None, 0.0

    def _score_everything_queued(self) -> None:
        """Score until the queue and the waiting groups are empty."""
        while True:
            for index in range(len(self.ref_actors)):
                self._feed_ref_slot(index)
            self._drain_inflight()
            if not self._unscored and self.rollout_queue.qsize() == 0:
                return

    def _train(self, batch_ref: Any, batch: list[Any], waited: float) -> dict[str, Any]:
        cfg = self.cfg
        debug_ids = None
        if cfg.get("debug_logging_enabled") and self.tokenizer is not None:
            count = cfg.get("debug_num_samples_per_step", 1)
            debug_ids = [t.sequence_id for t in batch[:count]]
        self._train_results = {}
        for rank, trainer in enumerate(self.trainers):
            ref = trainer.train_step.remote(batch_ref, waited, debug_ids)
            self._inflight[ref] = _Call("train", rank, trainer)
        # Collectors and reference actors keep working while the trainers step.
        while len(self._train_results) < len(self.trainers):
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=1.0)
            self._process(ready, relaunch=not self.synchronous)
        self.ledger.trained(self.state.step + 1, batch)
        return self._train_results[0]

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Save everything a run needs to continue exactly, atomically.

        The pipeline is quiesced first: collectors finish their batch (the queue is emptied
        meanwhile so none stays blocked) and reference actors finish scoring. Groups taken
        from the queue and scored groups still waiting for room in the buffer go into the
        checkpoint, and stay with the driver to be scored and added as before.

        Returns:
            Path: The checkpoint folder ``run_dir/checkpoints/step_NNNNNN``.
        """
        start = time.perf_counter()
        held: list[Any] = []
        self._drain_inflight(held=held)
        if held:
            self._unscored.append(ray.put(held))
        checkpoints = self.run_dir / "checkpoints"
        final = checkpoints / f"step_{self.state.step:06d}"
        tmp = checkpoints / f".tmp-step_{self.state.step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self._get_all(
            [t.save_checkpoint.remote(str(tmp)) for t in self.trainers], "trainer checkpoint"
        )
        unscored = [group for groups in ray.get(list(self._unscored)) for group in groups]
        unbuffered = []
        for batch, groups in zip(self._to_buffer, ray.get([b.groups_ref for b in self._to_buffer])):
            for group in groups[batch.added :]:
                kept = [t for t in group if t.sequence_id not in batch.skip]
                if kept:
                    unbuffered.append(kept)
        pipeline = {
            "collectors": list(self._collector_states),
            "ref_actors": [
                self._ask("ref", index, "state_dict") for index in range(len(self.ref_actors))
            ],
            "unscored_groups": unscored,
            "unbuffered_groups": unbuffered,
            "replay_buffer": self._ask("sample", 0, "state_dict"),
            "seen_group_ids": sorted(self._seen_group_ids),
        }
        torch.save(pipeline, tmp / "pipeline.pt")
        (tmp / "state.json").write_text(
            json.dumps(
                {
                    "step": self.state.step,
                    "policy_version": self.state.policy_version,
                    "eval_history": self.state.eval_history,
                }
            )
        )
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = checkpoints / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, checkpoints / "latest")
        self._log({"checkpoint/time (s)": time.perf_counter() - start}, self.state.step)
        log.info("saved checkpoint %s", final)
        return final

    def restore(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint's pipeline state into freshly started actors.

        Trainers and collectors were already started from its weights (see
        `find_checkpoint` and the recipe).
        """
        state = json.loads((checkpoint_dir / "state.json").read_text())
        pipeline = torch.load(checkpoint_dir / "pipeline.pt", weights_only=False)
        if len(pipeline["collectors"]) != len(self.collectors):
            raise ValueError(
                f"{checkpoint_dir} has {len(pipeline['collectors'])} collectors, the config "
                f"{len(self.collectors)}: orchestration.num_inference_workers must not change "
                "on resume"
            )
        self.state.step = state["step"]
        self.state.policy_version = state["policy_version"]
        self._collector_start_version = state["policy_version"]  # the weights they loaded
        self.state.eval_history = [tuple(item) for item in state["eval_history"]]
        calls = [
            c.load_state_dict.remote(s)
            for c, s in zip(self.collectors, pipeline["collectors"])
            if s is not None
        ]
        self._collector_states = list(pipeline["collectors"])
        for actor, ref_state in zip(self.ref_actors, pipeline["ref_actors"]):
            calls.append(actor.load_state_dict.remote(ref_state))
        buffer_state = pipeline["replay_buffer"]
        calls.append(self.replay_buffer.load_state_dict.remote(buffer_state))
        self._get_all(calls, "restoring the checkpoint")
        self._seen_group_ids = set(pipeline["seen_group_ids"])
        if pipeline["unscored_groups"]:
            self._unscored.append(ray.put(pipeline["unscored_groups"]))
        # The driver holds what it hands on, as in a run that never stopped.
        in_buffer = [[trajectory] for trajectory, _ in buffer_state["items"]]
        if in_buffer:
            batch = self._hold(in_buffer)
            self._taken_by_buffer(batch, batch.num_groups)
        if pipeline["unbuffered_groups"]:
            self._to_buffer.append(self._hold(pipeline["unbuffered_groups"]))

    @staticmethod
    def _hold(groups: list[list[Any]]) -> ScoredBatch:
        return ScoredBatch(
            ray.put(groups),
            [[t.sequence_id for t in group] for group in groups],
            max(t.policy_version for group in groups for t in group),
        )

    def _after_train_step(self, metrics: dict[str, Any], batch: list[Any], sync_every: int) -> None:
        self.state.step += 1
        step = self.state.step
        buffer_stats = self._ask("sample", 0, "stats")
        metrics = dict(metrics)
        pi_logprobs = metrics.pop("debug_pi_logprobs", None)
        if pi_logprobs and self.metric_logger is not None:
            for name, (columns, rows) in debug_tables(
                batch, pi_logprobs, self.tokenizer, step
            ).items():
                self.metric_logger.log_table.remote(rows, columns, name, step=step)
        metrics.update(
            {
                "queues/train_replay_buffer_size": float(buffer_stats["size"]),
                "queues/replay_buffer_dropped_stale": float(buffer_stats["dropped_stale"]),
                "queues/rollout_queue_size": float(self.rollout_queue.qsize()),
                "queues/replay_buffer_batches_waiting": float(len(self._to_buffer)),
                "queues/replay_buffer_duplicate_groups": float(self.num_duplicate_groups),
                "train_actor_training/policy_version": float(self.state.policy_version),
            }
        )
        if step % sync_every == 0:
            metrics.update(self.sync_weights())
            self._forget_stale()
        total = metrics.get("train_actor_performance/total_step_time (s)", 0.0)
        for key in ("time_weight_sync (s)", "time_weight_gather (s)"):
            value = metrics.get(f"train_actor_performance/{key}")
            if value is not None and total > 0:
                metrics[f"train_actor_performance/pct_{key.replace(' (s)', '')} (%)"] = (
                    100.0 * value / total
                )
        if total > 0:
            metrics["train_actor_performance/pct_time_grpo_steps (%)"] = (
                100.0 * metrics["train_actor_performance/time_grpo_steps (s)"] / total
            )
            metrics["train_actor_performance/pct_time_waiting_buffer (%)"] = (
                100.0 * metrics["train_actor_performance/time_waiting_buffer (s)"] / total
            )
        self.state.last_metrics = metrics
        self._log(metrics, step)

    def sync_weights(self) -> dict[str, float]:
        """Gather the trainer's weights once and hand the same object to every collector.

        Returns:
            dict[str, float]: Gather and sync timings.
        """
        start = time.perf_counter()
        gathered = [t.gather_hf_weights.remote() for t in self.trainers]
        self._get_all(gathered[1:], "trainer weight gather")
        payload = self._get_all([gathered[0]], "trainer[0] weight gather")[0]
        gather_time = time.perf_counter() - start
        # The trainer put the weights in the object store once; every collector reads that
        # same object, and applies it between generation batches.
        for collector in self.collectors:
            collector.receive_weights.remote(
                payload["weights"], payload["version"], payload["checksum"], payload["probe"]
            )
        self.state.policy_version = payload["version"]
        # Kept (a reference; the weights stay in the object store) for a replaced collector.
        self._last_weights = payload
        return {
            "train_actor_performance/time_weight_gather (s)": gather_time,
            "train_actor_performance/time_weight_sync (s)": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ the end

    def verify_weight_sync(self) -> bool:
        """Check that every collector computes with exactly the trainer's current weights.

        Pending weights are applied first. Logs ``weight_sync/in_sync`` (1 or 0).

        Returns:
            bool: True if every collector's checksum equals the trainer's.
        """
        trainer_sums = self._get_all(
            [t.weights_checksum.remote() for t in self.trainers], "trainer checksum"
        )
        expected = trainer_sums[0]
        self._get_all(
            [c.apply_pending_weights.remote() for c in self.collectors], "collector weight update"
        )
        got = self._get_all(
            [c.get_weights_checksum.remote() for c in self.collectors], "collector checksum"
        )
        in_sync = all(checksum == expected for checksum in got)
        self._log({"weight_sync/in_sync": float(in_sync)}, self.state.step)
        if not in_sync:
            log.error("collector weights differ from the trainer's: %s vs %s", got, expected)
        return in_sync

    def save_final_checkpoint(self) -> Path:
        out_dir = self.run_dir / "final"
        self._get_all(
            [t.save_hf_checkpoint.remote(str(out_dir)) for t in self.trainers], "trainer checkpoint"
        )
        return out_dir

    def shutdown(self) -> None:
        """End every actor of the run (idempotent)."""
        self.ledger.close()
        if self.metric_logger is not None:
            try:
                ray.get(self.metric_logger.close.remote(), timeout=30)
            except Exception as error:  # noqa: BLE001 - best effort at shutdown
                log.warning("metric logger did not close cleanly: %s", error)
        for actor in [*self.collectors, *self.ref_actors, *self.trainers]:
            ray.kill(actor, no_restart=True)
        for actor in (self.replay_buffer, self.metric_logger):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.rollout_queue is not None:
            self.rollout_queue.shutdown(force=True)
        self.collectors, self.ref_actors, self.trainers = [], [], []
        self.replay_buffer = self.metric_logger = self.rollout_queue = None


class RunLedger:
    """Which sequences were scored and which were trained on, one JSON line per event.

    It is how a run proves that every trajectory was generated, scored and trained on
    exactly once, and it survives a crash (each line is flushed).

    Args:
        run_dir (Path): The run folder; writes ``scored.jsonl`` and ``trained.jsonl``.
    """

    def __init__(self, run_dir: Path) -> None:
        self.scored_file = open(run_dir / "scored.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.trained_file = open(run_dir / "trained.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    @staticmethod
    def _write(file: Any, record: dict[str, Any]) -> None:
        file.write(json.dumps(record) + "\n")
        file.flush()

    def scored(self, step: int, sequence_ids: list[str]) -> None:
        self._write(self.scored_file, {"step": step, "sequence_ids": sequence_ids})

    def trained(self, step: int, batch: list[Any]) -> None:
        self._write(
            self.trained_file,
            {
                "step": step,
                "sequence_ids": [t.sequence_id for t in batch],
                "group_ids": [t.group_id for t in batch],
                "policy_versions": [t.policy_version for t in batch],
            },
        )

    def close(self) -> None:
        self.scored_file.close()
        self.trained_file.close()


def debug_tables(
    batch: list[Any], pi_logprobs: dict[str, list[float]], tokenizer: Any, step: int
) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """Per-sample and per-token debug tables of the sequences in ``pi_logprobs``.

    Args:
        batch (list[ScoredTrajectory]): The trained batch.
        pi_logprobs (dict[str, list[float]]): Policy logprobs by ``sequence_id``.
        tokenizer: Tokenizer with ``decode(ids, skip_special_tokens=...)``.
        step (int): Training step.

    Returns:
        dict: ``{table_name: (columns, rows)}``.
    """
    sample_rows, token_rows = [], []
    sample_columns = token_columns = None
    for traj in batch:
        if traj.sequence_id not in pi_logprobs:
            continue
        pi = pi_logprobs[traj.sequence_id]
        sample = {
            "Sequence ID": traj.sequence_id,
            "Prompt": tokenizer.decode(traj.prompt_tokens.tolist(), skip_special_tokens=False),
            "Response": tokenizer.decode(traj.response_tokens.tolist(), skip_special_tokens=False),
            "Answer": traj.answer,
            "Advantage": float(traj.advantages),
            "Response Length": traj.response_len,
            "Policy Version": traj.policy_version,
            "Step": step,
        }
        for name, reward, success in zip(
            traj.reward_metadata["func_names"], traj.rewards.tolist(), traj.successes.tolist()
        ):
            sample[f"Reward_{name}"] = reward
            sample[f"Success_{name}"] = success
        sample_columns = list(sample)
        sample_rows.append(list(sample.values()))
        generated, ref = traj.logprobs.tolist(), traj.ref_logprobs.tolist()
        for position, token_id in enumerate(traj.response_tokens.tolist()):
            token = {
                "Sequence ID": traj.sequence_id,
                "Token Position": position,
                "Token ID": token_id,
                "Decoded Token": tokenizer.decode([token_id], skip_special_tokens=False),
                "Generated Logprob": generated[position],
                "Ref Logprob": ref[position],
                "Pi Logprob": pi[position],
                "Abs Diff Pi-Ref": abs(pi[position] - ref[position]),
                "Abs Diff Pi-Generated": abs(pi[position] - generated[position]),
                "Step": step,
            }
            token_columns = list(token)
            token_rows.append(list(token.values()))
    tables = {}
    if sample_rows:
        tables["per_sample_debug_table"] = (sample_columns, sample_rows)
    if token_rows:
        tables["per_token_debug_table"] = (token_columns, token_rows)
    return tables
