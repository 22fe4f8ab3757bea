"""The actor supervisor: starts every actor of a run, replaces dead ones, ends them all.

It owns the actor handles (always the current ones, replacements included), the record of
recoveries, the state each collector reached after its last finished batch, and the names that
errors use (``inference[0]``, ``ref[1]``, ``replay_buffer``, ``training[0]``). It carries
out what the loop decided (`grpo.orchestrator.faults`): `replace` starts a new actor in a dead
one's place, `restart_pipeline` starts every actor but the metric logger again from a
checkpoint; what a replacement needs to catch up is the loop's to do.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from grpo.config import ConfigError, InstantiationError, RunConfig, locate
from grpo.config.instantiate import keyword_names
from grpo.config.run import ROLES
from grpo.errors import ActorFailedError, TrainerDiedError, describe
from grpo.observability import metric_names as names
from grpo.observability.logs import actor_log_path, is_verbose, logs_dir, with_output_to
from grpo.observability.metric_logger import DEFAULT_METRIC_LOGGER
from grpo.orchestrator.checkpointer import checkpoint_policy_version, latest_checkpoint_text
from grpo.workers.gc_pause import PAUSE_GC_HOOK, resumes_gc
from grpo.workers.rollout_queue import RolloutQueue
from grpo.workers.training_checkpoint import ADAPTER_SUBDIR, MODEL_SUBDIR

log = logging.getLogger("grpo")


def init_ray(cfg: RunConfig) -> None:
    """Start a local Ray cluster, or join one when ``ray.address`` is set.

    Unless ``log_level`` is debug, Ray does not forward the actors' output to this process
    (each actor writes its own log file, see `grpo.observability.logs`) and its own start-up messages go
    through the root logger (the run's ``driver.log`` under ``grpo run``) instead of stderr,
    and it does not print the errors of results the driver never fetched.
    """
    if ray.is_initialized():
        return
    verbose = is_verbose(cfg.log_level)
    if not verbose:
        # Results the driver lets go of unread (a failed generation call's second return, the
        # calls in flight when a run stops) would have their errors logged when garbage
        # collected, after the stop line and with the run's log handlers gone: Python's last
        # resort would print each remote traceback on the terminal. The failure that matters
        # was fetched, and stopped the run naming its cause.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    kwargs: dict[str, Any] = {
        # The actors' processes import and build with garbage collection paused.
        "runtime_env": {"worker_process_setup_hook": PAUSE_GC_HOOK},
        "include_dashboard": False,
        "log_to_driver": verbose,
        "configure_logging": verbose,
    }
    if not verbose:
        # configure_logging=False leaves the "ray" logger with no handler; propagating, its
        # records reach the root logger's handlers (Python's last resort prints warnings).
        logging.getLogger("ray").propagate = True
    if cfg.ray.address:
        kwargs["address"] = cfg.ray.address
    else:
        if cfg.ray.num_cpus is not None:
            kwargs["num_cpus"] = cfg.ray.num_cpus
        if cfg.ray.num_gpus is not None:
            kwargs["num_gpus"] = cfg.ray.num_gpus
    ray.init(**kwargs)


def _resources(section: Any) -> dict[str, Any]:
    """The Ray resources of an actor from its config section: ``num_cpus``, ``num_gpus`` and
    its custom ``resources`` (which place it on the nodes that have them)."""
    resources: dict[str, Any] = {"num_cpus": section.num_cpus, "num_gpus": section.num_gpus}
    if section.resources:
        resources["resources"] = dict(section.resources)
    return resources


def _on_driver_node() -> dict[str, Any]:
    """Ray options that keep a coordination actor (rollout queue, replay buffer, metric logger)
    on the driver's node.

    They need no CPU of their own, so Ray would put them on any node, and a lost generation
    node would take the queue with it. The run cannot outlive the driver's node anyway.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    driver_node = ray.get_runtime_context().get_node_id()
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(driver_node, soft=False),
    }


def actor_demand(section: Any) -> dict[str, float]:
    """One actor's resources in Ray's node-resource names (``CPU``, ``GPU``, custom ones)."""
    demand = {"CPU": float(section.num_cpus), "GPU": float(section.num_gpus)}
    demand.update({name: float(amount) for name, amount in section.resources.items()})
    return {name: amount for name, amount in demand.items() if amount > 0}


def placement_problems(
    nodes: list[dict[str, float]], demands: list[tuple[str, str, int, dict[str, float]]]
) -> list[str]:
    """What stops each role's actors from fitting on the cluster's nodes.

    Ray waits forever for a node that can host an actor; a config that asks for a resource no
    node has (a custom resource, a GPU on a CPU cluster) would hang there instead of failing.
    Each role is checked alone: its actors must fit on the nodes' total resources.

    Args:
        nodes (list[dict[str, float]]): Total resources of each alive node (``ray.nodes()``).
        demands (list[tuple[str, str, int, dict[str, float]]]): Per role: its config
            section, the ``orchestration`` key of its count, the count, and `actor_demand`.

    Returns:
        list[str]: One ``key: what is wrong`` line per role that does not fit.

    Example:
        >>> placement_problems([{"CPU": 4}], [("training", "num_training_workers", 1,
        ...     {"CPU": 1, "trainer_node": 1})])[0].split(":")[0]
        'training.resources'
    """
    described = "; ".join(
        "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(node.items()) if _shown(k)) + "}"
        for node in nodes
    )
    problems = []
    for section, count_key, count, demand in demands:
        if count == 0 or not demand:
            continue
        missing = [name for name in demand if not any(node.get(name, 0) > 0 for node in nodes)]
        if missing:
            fields = {"CPU": "num_cpus", "GPU": "num_gpus"}
            field_name = fields.get(missing[0], "resources") if len(missing) == 1 else "resources"
            problems.append(
                f"{section}.{field_name}: each {section} actor needs {_format(demand)}, but no "
                f"node of the Ray cluster has {', '.join(missing)} (nodes: {described})"
            )
            continue
        fits = sum(
            int(min(node.get(name, 0) / amount + 1e-9 for name, amount in demand.items()))
            for node in nodes
        )
        if fits < count:
            problems.append(
                f"orchestration.{count_key}: {count} {section} actors need {_format(demand)} "
                f"each, but the Ray cluster's nodes fit {fits} (nodes: {described})"
            )
    return problems


def _shown(resource: str) -> bool:
    # Ray adds node:<ip> and memory entries to every node; they say nothing about placement.
    return not resource.startswith("node:") and resource not in (
        "memory",
        "object_store_memory",
    )


def _format(demand: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in demand.items()) + "}"


def check_placement(cfg: RunConfig) -> None:
    """Refuse, before any actor starts, a config whose actors no node of the cluster can host.

    Raises:
        ConfigError: Naming each role that does not fit, what one actor needs and what the
            nodes have.
    """
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    demands = [
        (
            role.name,
            role.count_key,
            getattr(cfg.orchestration, role.count_key),
            actor_demand(getattr(cfg, role.name)),
        )
        for role in ROLES
    ]
    problems = placement_problems(nodes, demands)
    if problems:
        raise ConfigError(problems)


class Role(enum.Enum):
    """What an actor does in the run. Its value is the actor's name in messages and log files,
    and, for the placed roles, the config section that configures it."""

    INFERENCE = "inference"
    ROLLOUT_QUEUE = "rollout_queue"
    REF = "ref"
    REPLAY_BUFFER = "replay_buffer"
    TRAINING = "training"
    METRIC_LOGGER = "metric_logger"


_INDEXED = {Role.INFERENCE, Role.REF, Role.TRAINING}


def actor_name(role: Role, index: int = 0) -> str:
    """``inference[0]``, ``ref[1]``, ``training[0]``, ``replay_buffer``, ..."""
    return f"{role.value}[{index}]" if role in _INDEXED else role.value


def role_and_index(name: str) -> tuple[Role, int]:
    """The inverse of `actor_name`: ``"inference[1]"`` -> ``(Role.INFERENCE, 1)``."""
    role, _, index = name.partition("[")
    return Role(role), int(index.rstrip("]") or 0)


def actor_started(actor: Any) -> bool:
    """Whether Ray reports ``actor``'s constructor done (its state ALIVE); False if unknown.

    A frozen actor cannot say so itself; the cluster's actor table can.
    """
    handle = getattr(actor, "actor", actor)  # the rollout queue's handle is inside it
    try:
        return ray._private.state.actors(handle._actor_id.hex())["State"] == "ALIVE"
    except Exception:  # noqa: BLE001 - a private API: if it moved, rely on answers alone
        return False


def _kill_frozen_process(actor: Any) -> None:
    """SIGKILL an actor's process if it runs on this node (best effort).

    `ray.kill` marks the actor dead at once, but a process that is frozen (SIGSTOP, a
    debugger, stuck in the kernel) never handles Ray's request to exit and keeps its memory,
    and on a GPU its device memory. On another node only Ray can end it.
    """
    import os
    import signal

    try:
        info = ray._private.state.actors(actor._actor_id.hex())
        if info["Address"]["NodeID"] == ray.get_runtime_context().get_node_id() and info["Pid"]:
            os.kill(int(info["Pid"]), signal.SIGKILL)
    except Exception as error:  # noqa: BLE001 - the process may be gone, or the API changed
        log.debug("could not SIGKILL the process of %s: %s", actor, error)


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


class ActorSupervisor:
    """Starts, names, replaces and ends the actors of one run.

    Args:
        cfg (RunConfig): The run config.
        run_dir (Path): The run folder (logs; errors name its latest checkpoint).
        current_step (Callable[[], int]): The training step now (recoveries record it).
        dataset: The training dataset, built once by the caller and shared by every
            collector through the object store; None builds it from ``cfg.dataset`` in each.
    """

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        current_step: Callable[[], int],
        dataset: Any = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.current_step = current_step
        self.dataset = ray.put(dataset) if dataset is not None else cfg.dataset
        # Unless log_level is debug, each actor's process writes to its own file in
        # <run_dir>/logs (grpo.observability.logs) and Ray forwards nothing to the terminal.
        self.log_files = not is_verbose(cfg.log_level)
        self.collectors: list[Any] = []
        self.ref_actors: list[Any] = []
        self.trainers: list[Any] = []
        self.replay_buffer: Any = None
        self.rollout_queue: RolloutQueue | None = None
        self.metric_logger: Any = None
        # Per collector, its state after its last finished batch: where a replacement starts.
        self.collector_states: list[dict[str, Any] | None] = []
        # The weights new collectors load, and their policy version: the base model's 0, or a
        # checkpoint's (a replacement starts there too, then catches up to the latest).
        self.collector_model_dir = str(cfg.base_model_path)
        self.collector_weights_version = 0
        # With training.lora: the base model, and the adapter of that version (None: none).
        self.collector_adapter_dir: str | None = None
        self.recoveries: list[Recovery] = []
        self.recovering: dict[str, Recovery] = {}  # replaced, first call not back yet

    # ------------------------------------------------------------------ start

    def _actor_class(self, cls: type, name: str) -> type:
        """A subclass of ``cls`` whose process writes its output to the actor's log file
        (unless ``log_level`` is debug) and collects garbage again once the actor is built."""
        if self.log_files:
            cls = with_output_to(cls, actor_log_path(self.run_dir, name))
        return resumes_gc(cls)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Send ``metrics`` of ``step`` to the metric logger (none yet: dropped)."""
        if self.metric_logger is not None and metrics:
            self.metric_logger.log_dict.remote(metrics, step=step)

    def output_hint(self, name: str | None = None) -> str:
        """Where to read what an actor printed, for error messages ("" when on the terminal).

        Args:
            name (str | None): The actor's name (`actor_name`); None when not known.

        Returns:
            str: ``" (its output: <run_dir>/logs/<actor>.log)"`` (the folder when ``name`` is
            None), or "" with log_level debug.
        """
        if not self.log_files:
            return ""
        if name is None:
            return f" (each actor's output: {logs_dir(self.run_dir)})"
        return f" (its output: {actor_log_path(self.run_dir, name)})"

    def start_pipeline(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> None:
        """Start every actor but the metric logger; trainers and collectors from
        ``checkpoint_dir``.

        Collectors and reference actors are created first: their start-up (a vLLM engine)
        then runs while the trainers set up, which is the one start that is waited for.
        With ``training.lora`` collectors load the checkpoint's adapter on the base model;
        they label what they sample with the version of the weights their engine holds.
        """
        self.rollout_queue = self._new_actor(Role.ROLLOUT_QUEUE)
        self.replay_buffer = self._new_actor(Role.REPLAY_BUFFER)
        orchestration = self.cfg.orchestration
        self.ref_actors = [
            self._new_actor(Role.REF, i) for i in range(orchestration.num_ref_workers)
        ]
        if checkpoint_dir is not None:
            if self.cfg.training.lora is not None:
                self.collector_adapter_dir = str(checkpoint_dir / ADAPTER_SUBDIR)
            else:
                self.collector_model_dir = str(checkpoint_dir / MODEL_SUBDIR)
            self.collector_weights_version = checkpoint_policy_version(checkpoint_dir)
        num_collectors = orchestration.num_inference_workers
        self.collectors = [self._new_actor(Role.INFERENCE, i) for i in range(num_collectors)]
        self.collector_states = [None] * num_collectors
        self.start_trainers(pad_token_id=pad_token_id, checkpoint_dir=checkpoint_dir)

    def start_metric_logger(self) -> Any:
        """Start the logger actor: the class the ``metric_logger`` node's ``_component_`` names.

        Any class with `MetricLogger`'s methods will do. The node's other keys are its
        keywords; ``log_dir`` (the run folder) and ``config`` (the resolved run config) are
        added when the node does not set them and the class takes them.

        Raises:
            InstantiationError: If ``_component_`` does not import or is not a class (the
                logger is a Ray actor, so it must be one).
        """
        node = dict(self.cfg.metric_logger)
        target = node.pop("_component_", DEFAULT_METRIC_LOGGER)
        try:
            logger_cls = locate(target)
        except InstantiationError as exc:
            raise InstantiationError(f"metric_logger._component_: {exc}") from None
        if not isinstance(logger_cls, type):
            raise InstantiationError(
                f"metric_logger._component_: {target} is not a class; the metric logger runs "
                "as a Ray actor, so name a class with MetricLogger's methods"
            )
        accepted = keyword_names(logger_cls)  # None: it takes **kwargs
        defaults = {"log_dir": str(self.run_dir), "config": self.cfg.model_dump()}
        for name, value in defaults.items():
            if accepted is None or name in accepted:
                node.setdefault(name, value)
        logger_cls = self._actor_class(logger_cls, actor_name(Role.METRIC_LOGGER))
        self.metric_logger = ray.remote(**_on_driver_node())(logger_cls).remote(**node)
        return self.metric_logger

    def start_trainers(self, pad_token_id: int, checkpoint_dir: Path | None = None) -> list[Any]:
        from grpo.workers.trainer import PyTorchActorModel

        cfg, training = self.cfg, self.cfg.training
        world_size = cfg.orchestration.num_training_workers

        def trainer_class(rank: int) -> Any:
            trainer_cls = self._actor_class(PyTorchActorModel, actor_name(Role.TRAINING, rank))
            return trainer_cls.as_remote(**_resources(training))

        self.trainers = [
            trainer_class(rank).remote(
                rank=rank,
                world_size=world_size,
                model_dir=cfg.base_model_path,
                num_steps=cfg.orchestration.num_steps,
                target_tokens_per_batch=cfg.target_tokens_per_batch,
                share_prompts=cfg.share_prompts,
                pad_token_id=pad_token_id,
                config=training,
                seed=cfg.seed,
                temperature=cfg.inference.temperature,
                empty_cache_after_step=cfg.inference.sleep_while_training,
            )
            for rank in range(world_size)
        ]
        init_method = (
            ray.get(self.trainers[0].get_dist_address.remote()) if world_size > 1 else None
        )
        checkpoint = str(checkpoint_dir) if checkpoint_dir else None
        self.get_all(
            [t.setup.remote(init_method, checkpoint) for t in self.trainers], "trainer set-up"
        )
        return self.trainers

    def _new_actor(self, role: Role, index: int = 0) -> Any:
        """A new actor for ``role``: the rollout queue, replay buffer, a reference actor or a
        collector (trainers start together, in `start_trainers`)."""
        cfg = self.cfg
        if role is Role.ROLLOUT_QUEUE:
            return RolloutQueue(
                maxsize=cfg.inference.queue_maxsize, actor_options=_on_driver_node()
            )
        if role is Role.REPLAY_BUFFER:
            from grpo.workers.replay_buffer import ReplayBufferActor

            actor_cls = self._actor_class(ReplayBufferActor, actor_name(role))
            return ray.remote(**_on_driver_node())(actor_cls).remote(
                capacity=cfg.orchestration.replay_buffer_size,
                max_policy_lag=cfg.orchestration.max_policy_lag,
                seed=cfg.seed,
            )
        if role is Role.REF:
            from grpo.workers.ref import RefActor

            actor_cls = self._actor_class(RefActor, actor_name(role, index))
            return ray.remote(**_resources(cfg.ref))(actor_cls).remote(
                model_dir=cfg.base_model_path,
                target_tokens_per_batch=cfg.target_tokens_per_batch,
                share_prompts=cfg.share_prompts,
                config=cfg.ref,
                load_model=cfg.uses_reference_model() and cfg.training.lora is None,
                temperature=cfg.inference.temperature,
            )
        assert role is Role.INFERENCE, role
        from grpo.workers.collector import SyncLLMCollector

        # Threaded actor (max_concurrency 4): evaluate and receive_weights must get through
        # while generate_batch waits on a full rollout queue, or evaluation deadlocks.
        collector_cls = self._actor_class(SyncLLMCollector, actor_name(role, index))
        return collector_cls.as_remote(**_resources(cfg.inference)).remote(
            worker_id=index,
            num_workers=cfg.orchestration.num_inference_workers,
            model_dir=self.collector_model_dir,
            dataset=self.dataset,
            rollout_queue=self.rollout_queue,
            config=cfg.inference,
            seed=cfg.seed,
            policy_version=self.collector_weights_version,
            environment=cfg.environment,
            reward_functions=cfg.reward_functions,
            reward_timeout_s=cfg.reward_timeout_s,
            lora=cfg.training.lora,
            adapter_dir=self.collector_adapter_dir,
        )

    # ------------------------------------------------------------------ calls

    def actor(self, role: Role, index: int = 0) -> Any:
        """The current actor of ``role`` (a replacement once the first one died)."""
        if role is Role.ROLLOUT_QUEUE:
            return self.rollout_queue
        if role is Role.REPLAY_BUFFER:
            return self.replay_buffer
        if role is Role.METRIC_LOGGER:
            return self.metric_logger
        return {Role.INFERENCE: self.collectors, Role.REF: self.ref_actors}.get(
            role, self.trainers
        )[index]

    def get_all(self, refs: list[Any], what: str = "") -> list[Any]:
        """``ray.get`` for calls that are not redone: a failure stops the run, named.

        Raises:
            ActorFailedError: An actor died or raised.
        """
        try:
            return ray.get(refs)
        except RayActorError as error:
            dead_trainer = self.dead_trainer()
            if dead_trainer is not None:
                raise TrainerDiedError(
                    f"{dead_trainer} died during {what}{self.output_hint(dead_trainer)}: "
                    f"{describe(error)}"
                ) from error
            raise ActorFailedError(
                f"{what or 'an actor'} failed, an actor died ({describe(error)})"
                f"{self.output_hint()}: "
                "resume from "
                f"{latest_checkpoint_text(self.run_dir)}"
            ) from error
        except RayTaskError as error:
            raise ActorFailedError(f"{what or 'an actor'} failed: {describe(error)}") from error

    def save_trainers(self, folder: Path, hf: bool = False) -> None:
        """Have every trainer write its checkpoint (``model/`` and ``trainer/``) into
        ``folder``, or with ``hf`` the policy alone as an HF-format folder; returns once all
        are done.

        Raises:
            TrainerDiedError: A trainer died meanwhile (`get_all`).
        """
        method = "save_hf_checkpoint" if hf else "save_checkpoint"
        calls = [getattr(t, method).remote(str(folder)) for t in self.trainers]
        self.get_all(calls, "training checkpoint")

    def returned(self, role: Role, index: int, actor: Any) -> None:
        """A call of ``actor`` came back: a replacement's first result ends its recovery."""
        name = actor_name(role, index)
        if name in self.recovering and actor is self.actor(role, index):
            recovery = self.recovering.pop(name)
            recovery.seconds_to_work = time.perf_counter() - recovery.started
            self.log_metrics(
                {"faults/time_to_work_again (s)": recovery.seconds_to_work}, self.current_step()
            )

    # ------------------------------------------------------------------ faults

    def replace(self, role: Role, index: int, dead: Any, error: BaseException) -> Recovery | None:
        """Start a new actor in place of the ``dead`` one, unless an earlier failure did.

        The new one starts from the weights new actors load; catching it up (a collector's
        stream position and weights, a buffer's contents) is the caller's. A trainer is never
        replaced alone (`restart_pipeline`).

        Returns:
            Recovery | None: The record of this replacement, for the caller to time and keep
            (`record_recovery`) once the new actor is caught up; None if replaced already.
        """
        if dead is not self.actor(role, index):
            return None
        name = actor_name(role, index)
        step = self.current_step()
        log.warning(
            "%s died at step %d; replacing it%s: %s",
            *(name, step, self.output_hint(name), describe(error)),
        )
        new = self._new_actor(role, index)
        if role is Role.INFERENCE:
            self.collectors[index] = new
        elif role is Role.REF:
            self.ref_actors[index] = new
        elif role is Role.ROLLOUT_QUEUE:
            self.rollout_queue = new
        else:
            self.replay_buffer = new
        return Recovery(name, step, 0.0, describe(error))

    def kill(self, name: str, reason: str) -> None:
        """Kill the actor ``name`` because it holds the run up (stuck, frozen, or unable to
        receive weights); its call in flight then fails and it is replaced like one that died.

        Args:
            name (str): The actor's name (`actor_name`).
            reason (str): Why, for the log.
        """
        role, index = role_and_index(name)
        actor = self.actor(role, index)
        actor = getattr(actor, "actor", actor)  # the rollout queue's handle is inside it
        log.warning("killing %s: %s", name, reason)
        _kill_frozen_process(actor)
        ray.kill(actor, no_restart=True)

    def record_recovery(self, recovery: Recovery) -> None:
        """Keep and log a finished replacement; its first result back ends it (`returned`)."""
        recovery.seconds = time.perf_counter() - recovery.started
        self.recoveries.append(recovery)
        self.recovering[recovery.actor] = recovery
        self.log_metrics(
            {
                names.FAULTS_ACTOR_RESTARTS: float(len(self.recoveries)),
                "faults/time_recovering (s)": recovery.seconds,
            },
            recovery.step,
        )

    def dead_trainer(self) -> str | None:
        """The name of a trainer that is dead, or None if every trainer answers.

        A failed ``ray.get`` over many actors' calls does not say whose actor died; the
        trainers are asked directly (a dead actor's call fails at once).
        """
        for rank, trainer in enumerate(self.trainers):
            try:
                ray.get(trainer.__ray_ready__.remote(), timeout=30)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                return actor_name(Role.TRAINING, rank)
        return None

    def restart_pipeline(self, pad_token_id: int, checkpoint_dir: Path | None) -> None:
        """End every actor but the metric logger and start them again from ``checkpoint_dir``.

        What a dead trainer held (policy, optimizer state) is gone, so everything that moved
        on from the checkpoint with it goes too: collectors (their weights and stream
        positions), reference actors, the buffer and the queue (groups of the lost steps).
        The metric logger lives on, so the run keeps one log and one W&B run.

        Args:
            pad_token_id (int): The tokenizer's pad id (for the trainers' packing).
            checkpoint_dir (Path | None): Where to start from; None: the base model.

        Raises:
            ActorFailedError: The nodes left cannot host a role's actors.
        """
        for actor in [*self.collectors, *self.ref_actors, *self.trainers, self.replay_buffer]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        try:
            check_placement(self.cfg)  # a lost node may have been the last that fit a role
        except ConfigError as error:
            raise ActorFailedError(f"cannot restart the run's actors: {error}") from error
        if self.rollout_queue is not None:
            self.rollout_queue.shutdown(force=True)
        self.recovering.clear()
        self.collector_model_dir = str(self.cfg.base_model_path)
        self.collector_adapter_dir = None
        self.collector_weights_version = 0
        self.start_pipeline(pad_token_id, checkpoint_dir)

    # ------------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        """The actors' states: collectors after their last batch, reference actors, buffer.

        Raises:
            ActorFailedError: A reference actor or the buffer died (the loop replaces a dead
                one before it saves: `Orchestrator.save_checkpoint`).
        """
        states = self.get_all(
            [actor.state_dict.remote() for actor in [*self.ref_actors, self.replay_buffer]],
            "actor states for a checkpoint",
        )
        return {
            "collectors": list(self.collector_states),
            "ref_actors": states[:-1],
            "replay_buffer": states[-1],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's actor states into freshly started actors.

        Raises:
            ValueError: The checkpoint has a different number of collectors.
        """
        if len(state["collectors"]) != len(self.collectors):
            raise ValueError(
                f"has {len(state['collectors'])} collectors, the config "
                f"{len(self.collectors)}: orchestration.num_inference_workers must not change "
                "on resume"
            )
        calls = [
            c.load_state_dict.remote(s)
            for c, s in zip(self.collectors, state["collectors"])
            if s is not None
        ]
        self.collector_states = list(state["collectors"])
        for actor, ref_state in zip(self.ref_actors, state["ref_actors"]):
            calls.append(actor.load_state_dict.remote(ref_state))
        calls.append(self.replay_buffer.load_state_dict.remote(state["replay_buffer"]))
        self.get_all(calls, "restoring the checkpoint")

    # ------------------------------------------------------------------ the end

    def shutdown(self) -> None:
        """End every actor (idempotent); the metric logger closes its files first."""
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
