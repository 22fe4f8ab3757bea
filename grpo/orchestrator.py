"""Starts the actors of a run, drives them, and shuts them down.

The driver keeps exactly one call in flight per actor and reacts to whichever finishes
first (`ray.wait`), so generation, reference scoring and training overlap, and a dead actor
surfaces at once as an error naming it instead of a hang. The replay buffer's sample is
passed to the trainers as an ObjectRef: every training worker reads the same batch from the
object store, and each takes its share.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf
from ray.exceptions import RayActorError, RayTaskError
from ray.util.queue import Queue

log = logging.getLogger("grpo")


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


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


class Orchestrator:
    """Owns the actors of one run.

    Args:
        cfg (DictConfig): The validated run config.
        run_dir (Path): Folder for logs and checkpoints.
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
        self._inflight: dict[Any, tuple[str, int]] = {}
        self.stop_requested = False

    # ------------------------------------------------------------------ start-up

    def start_metric_logger(self) -> Any:
        from grpo.workers.metric_logger import MetricLogger

        node = to_container(self.cfg.get("metric_logger")) or {}
        node.pop("_component_", None)
        node.setdefault("log_dir", str(self.run_dir))
        node.setdefault("config", to_container(self.cfg))
        self.metric_logger = ray.remote(num_cpus=0)(MetricLogger).remote(**node)
        return self.metric_logger

    def start_rollout_queue(self) -> Queue:
        self.rollout_queue = Queue(maxsize=self.cfg.inference.queue_maxsize)
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
        from grpo.workers.trainer import PyTorchActorModel

        cfg, training = self.cfg, self.cfg.training
        world_size = cfg.orchestration.num_training_workers
        actor_cls = ray.remote(**_resources(training, default_cpus=1))(PyTorchActorModel)
        self.trainers = [
            actor_cls.remote(
                rank=rank,
                world_size=world_size,
                model_dir=cfg.base_model_path,
                optimizer=to_container(training.optimizer),
                lr_scheduler=to_container(training.get("lr_scheduler")),
                loss=to_container(training.loss),
                num_steps=cfg.orchestration.num_steps,
                target_tokens_per_batch=cfg.target_tokens_per_batch,
                pad_token_id=pad_token_id,
                ppo_epochs=training.ppo_epochs,
                clip_grad_norm=training.get("clip_grad_norm"),
                dtype=training.get("dtype", "float32"),
                seed=cfg.seed,
                mask_kind=training.get("mask_kind", "dense"),
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

    def start_ref_actors(self) -> list[Any]:
        from grpo.workers.ref import RefActor

        cfg = self.cfg
        ref_cfg = cfg.get("ref") or {}
        actor_cls = ray.remote(**_resources(ref_cfg, default_cpus=1))(RefActor)
        self.ref_actors = [
            actor_cls.remote(
                model_dir=cfg.base_model_path,
                reward_functions=to_container(cfg.reward_functions),
                rollout_queue=self.rollout_queue,
                replay_buffer=self.replay_buffer,
                target_tokens_per_batch=cfg.target_tokens_per_batch,
                reward_timeout_s=ref_cfg.get("reward_timeout_s", 10.0),
                reward_weights=to_container(ref_cfg.get("reward_weights")),
                dtype=ref_cfg.get("dtype", "float32"),
                mask_kind=ref_cfg.get("mask_kind", "dense"),
            )
            for _ in range(cfg.orchestration.num_ref_workers)
        ]
        return self.ref_actors

    def start_collectors(self, weights_dir: Path | None = None) -> list[Any]:
        """Start the vLLM collectors, from ``weights_dir`` (a checkpoint) or the base model."""
        from grpo.workers.collector import SyncLLMCollector

        cfg, inference = self.cfg, self.cfg.inference
        num_workers = cfg.orchestration.num_inference_workers
        # Threaded actor (max_concurrency 4): evaluate and receive_weights must get through
        # while generate_batch waits on a full rollout queue, or evaluation deadlocks.
        actor_cls = SyncLLMCollector.as_remote(**_resources(inference, default_cpus=1))
        self.collectors = [
            actor_cls.remote(
                worker_id=worker_id,
                num_workers=num_workers,
                model_dir=str(weights_dir) if weights_dir else cfg.base_model_path,
                engine_args=to_container(inference.get("engine_args")) or {},
                dataset=to_container(cfg.dataset),
                group_size=inference.group_size,
                max_generated_tokens=inference.max_generated_tokens,
                temperature=inference.temperature,
                top_p=inference.top_p,
                rollout_queue=self.rollout_queue,
                seed=cfg.seed,
                queue_put_timeout_s=inference.get("queue_put_timeout_s", 1.0),
                max_prompt_tokens=inference.get("max_prompt_tokens"),
                steps_before_weight_sync=inference.get("steps_before_weight_sync", 1),
            )
            for worker_id in range(num_workers)
        ]
        return self.collectors

    # ------------------------------------------------------------------ helpers

    def _get_all(self, refs: list[Any], what: str = "") -> list[Any]:
        try:
            return ray.get(refs)
        except (RayActorError, RayTaskError) as error:
            raise ActorFailedError(f"{what or 'an actor'} failed: {error}") from error

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.metric_logger is not None and metrics:
            self.metric_logger.log_dict.remote(metrics, step=step)

    # ------------------------------------------------------------------ the loop

    def request_stop(self) -> None:
        """Ask the loop to stop at the next step boundary (signal handlers call this)."""
        self.stop_requested = True

    def _launch(self, kind: str, index: int, ref: Any) -> None:
        self._inflight[ref] = (kind, index)

    def _launch_collector(self, index: int) -> None:
        batch_size = self.cfg.inference.batch_size
        self._launch("collector", index, self.collectors[index].generate_batch.remote(batch_size))

    def _actor_name(self, kind: str, index: int) -> str:
        return {"sample": "replay_buffer", "train": f"trainer[{index}]"}.get(
            kind, f"{'ref_actor' if kind == 'ref' else kind}[{index}]"
        )

    def _result(self, ref: Any) -> tuple[str, int, Any]:
        """Pop a finished call and return (kind, index, result); a failure names the actor."""
        kind, index = self._inflight.pop(ref)
        try:
            return kind, index, ray.get(ref)
        except (RayActorError, RayTaskError) as error:
            raise ActorFailedError(f"{self._actor_name(kind, index)} failed: {error}") from error

    def _handle_side_result(self, kind: str, index: int, result: Any, relaunch: bool) -> None:
        """Log a collector's or reference actor's result, and keep it busy."""
        if kind == "collector":
            self._log(result, self.state.step)
            if relaunch:
                self._launch_collector(index)
        elif kind == "ref":
            if result:
                self._log(result["metrics"], self.state.step)
                self.ledger.scored(self.state.step, result["sequence_ids"])
            if relaunch:
                self._launch("ref", index, self.ref_actors[index].step.remote())

    def run(self, evaluate: Any = None, on_step: Any = None) -> RunState:
        """Drive the actors until ``orchestration.num_steps`` training steps are done.

        Args:
            evaluate (callable | None): ``evaluate(step) -> dict`` run before the first step,
                every ``eval_every_n_steps`` and at the end.
            on_step (callable | None): ``on_step(state)`` after each training step (progress).

        Returns:
            RunState: Final step, policy version and last metrics.

        Raises:
            ActorFailedError: An actor died or raised; its name is in the message.
        """
        cfg = self.cfg
        num_steps = cfg.orchestration.num_steps
        eval_every = cfg.get("eval_every_n_steps") or 0
        synchronous = cfg.orchestration.get("synchronous", False)
        if evaluate is not None and self.state.step == 0:
            self.state.eval_history.append((0, evaluate(0)))

        while self.state.step < num_steps and not self.stop_requested:
            if synchronous:
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
        cfg = self.cfg
        if not any(kind == "collector" for kind, _ in self._inflight.values()):
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            for index, actor in enumerate(self.ref_actors):
                self._launch("ref", index, actor.step.remote())
        stall_timeout_s = cfg.orchestration.get("stall_timeout_s", 600)
        batch_size = cfg.training.batch_size
        wait_start = time.perf_counter()
        last_progress = time.monotonic()
        poll_delay = 0.02
        self._launch(
            "sample", 0, self.replay_buffer.sample.remote(batch_size, self.state.policy_version)
        )
        while not self.stop_requested:
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=1.0)
            if not ready:
                if time.monotonic() - last_progress > stall_timeout_s:
                    busy = sorted({self._actor_name(*v) for v in self._inflight.values()})
                    raise ActorFailedError(
                        f"no actor made progress for {stall_timeout_s:.0f} s (busy: {busy})"
                    )
                continue
            last_progress = time.monotonic()
            for ref in ready:
                kind, index, result = self._result(ref)
                if kind != "sample":
                    self._handle_side_result(kind, index, result, relaunch=True)
                elif result is None:
                    # Back off while the buffer fills: each poll is a Ray task.
                    time.sleep(poll_delay)
                    poll_delay = min(2 * poll_delay, 0.5)
                    self._launch(
                        "sample",
                        0,
                        self.replay_buffer.sample.remote(batch_size, self.state.policy_version),
                    )
                else:
                    return ref, result, time.perf_counter() - wait_start
        return None, None, 0.0

    def _next_batch_synchronously(self) -> tuple[Any, list[Any] | None, float]:
        """Generate with the current weights and score everything, then sample a batch."""
        cfg = self.cfg
        batch_size = cfg.training.batch_size
        wait_start = time.perf_counter()
        while not self.stop_requested:
            batch_ref = self.replay_buffer.sample.remote(batch_size, self.state.policy_version)
            batch = self._get_all([batch_ref], "replay_buffer")[0]
            if batch is not None:
                return batch_ref, batch, time.perf_counter() - wait_start
            for index in range(len(self.collectors)):
                self._launch_collector(index)
            self._drain_inflight(relaunch=False)
            self._score_everything_queued()
        return None, None, 0.0

    def _score_everything_queued(self) -> None:
        """Run reference steps until the queue is empty and every backlog is scored."""
        while True:
            for index, actor in enumerate(self.ref_actors):
                self._launch("ref", index, actor.step.remote())
            results = []
            while self._inflight:
                kind, index, result = self._result(next(iter(self._inflight)))
                self._handle_side_result(kind, index, result, relaunch=False)
                results.append(result)
            if all(result is None for result in results) and self.rollout_queue.qsize() == 0:
                return

    def _drain_inflight(self, relaunch: bool, held: list[Any] | None = None) -> None:
        """Wait for every in-flight call; if ``held`` is given, empty the queue meanwhile.

        Draining lets a collector blocked on a full queue finish its batch.
        """
        while self._inflight:
            if held is not None and self.rollout_queue.qsize():
                held.extend(self.rollout_queue.get_nowait_batch(self.rollout_queue.qsize()))
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=0.2)
            for ref in ready:
                kind, index, result = self._result(ref)
                self._handle_side_result(kind, index, result, relaunch=relaunch)
        if held is not None and self.rollout_queue.qsize():
            held.extend(self.rollout_queue.get_nowait_batch(self.rollout_queue.qsize()))

    def _train(self, batch_ref: Any, batch: list[Any], waited: float) -> dict[str, Any]:
        cfg = self.cfg
        debug_ids = None
        if cfg.get("debug_logging_enabled") and self.tokenizer is not None:
            count = cfg.get("debug_num_samples_per_step", 1)
            debug_ids = [t.sequence_id for t in batch[:count]]
        train_refs = [t.train_step.remote(batch_ref, waited, debug_ids) for t in self.trainers]
        for rank, ref in enumerate(train_refs):
            self._launch("train", rank, ref)
        # Collectors and reference actors keep working while the trainers step.
        results: dict[Any, Any] = {}
        while any(ref in self._inflight for ref in train_refs):
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                kind, index, result = self._result(ref)
                if kind == "train":
                    results[ref] = result
                else:
                    self._handle_side_result(
                        kind,
                        index,
                        result,
                        relaunch=not self.cfg.orchestration.get("synchronous", False),
                    )
        self.ledger.trained(self.state.step + 1, batch)
        return results[train_refs[0]]

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Save everything a run needs to continue exactly, atomically.

        The pipeline is quiesced first: collectors finish their batch (the queue is emptied
        meanwhile so none stays blocked), reference actors finish their step, and groups
        taken from the queue go into the checkpoint. After saving, those groups are handed to
        a reference actor so nothing is lost or scored twice.

        Returns:
            Path: The checkpoint folder ``run_dir/checkpoints/step_NNNNNN``.
        """
        start = time.perf_counter()
        held: list[Any] = []
        self._drain_inflight(relaunch=False, held=held)
        checkpoints = self.run_dir / "checkpoints"
        final = checkpoints / f"step_{self.state.step:06d}"
        tmp = checkpoints / f".tmp-step_{self.state.step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self._get_all(
            [t.save_checkpoint.remote(str(tmp)) for t in self.trainers], "trainer checkpoint"
        )
        pipeline = {
            "collectors": self._get_all(
                [c.state_dict.remote() for c in self.collectors], "collector state"
            ),
            "ref_actors": self._get_all(
                [r.state_dict.remote() for r in self.ref_actors], "ref_actor state"
            ),
            "held_groups": held,
            "replay_buffer": self._get_all(
                [self.replay_buffer.state_dict.remote()], "replay_buffer state"
            )[0],
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
        if held:
            self.ref_actors[0].add_backlog.remote(held)
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
        self.state.eval_history = [tuple(item) for item in state["eval_history"]]
        calls = [
            c.load_state_dict.remote(s) for c, s in zip(self.collectors, pipeline["collectors"])
        ]
        ref_states = pipeline["ref_actors"]
        for index, actor in enumerate(self.ref_actors):
            if index < len(ref_states):
                calls.append(actor.load_state_dict.remote(ref_states[index]))
        for extra in ref_states[len(self.ref_actors) :]:  # fewer ref actors now
            calls.append(self.ref_actors[0].add_backlog.remote(extra["backlog"]))
        calls.append(self.ref_actors[0].add_backlog.remote(pipeline["held_groups"]))
        calls.append(self.replay_buffer.load_state_dict.remote(pipeline["replay_buffer"]))
        self._get_all(calls, "restoring the checkpoint")

    def _after_train_step(self, metrics: dict[str, Any], batch: list[Any], sync_every: int) -> None:
        self.state.step += 1
        step = self.state.step
        buffer_stats = ray.get(self.replay_buffer.stats.remote())
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
                "train_actor_training/policy_version": float(self.state.policy_version),
            }
        )
        if step % sync_every == 0:
            metrics.update(self.sync_weights())
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
