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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf
from ray.exceptions import RayActorError, RayTaskError
from ray.util.queue import Queue

log = logging.getLogger("grpo")


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


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
        self._names: dict[Any, str] = {}

    # ------------------------------------------------------------------ start-up

    def start_metric_logger(self) -> Any:
        from grpo.workers.metric_logger import MetricLogger

        node = to_container(self.cfg.get("metric_logger")) or {}
        node.pop("_component_", None)
        node.setdefault("log_dir", str(self.run_dir))
        node.setdefault("config", to_container(self.cfg))
        self.metric_logger = ray.remote(num_cpus=0)(MetricLogger).remote(**node)
        self._names[self.metric_logger] = "metric_logger"
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
        self._names[self.replay_buffer] = "replay_buffer"
        return self.replay_buffer

    def start_trainers(self, pad_token_id: int) -> list[Any]:
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
        for rank, trainer in enumerate(self.trainers):
            self._names[trainer] = f"trainer[{rank}]"
        init_method = ray.get(self.trainers[0].get_dist_address.remote()) if world_size > 1 else None
        self._get_all([t.setup.remote(init_method) for t in self.trainers])
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
            )
            for _ in range(cfg.orchestration.num_ref_workers)
        ]
        for index, actor in enumerate(self.ref_actors):
            self._names[actor] = f"ref_actor[{index}]"
        return self.ref_actors

    def start_collectors(self) -> list[Any]:
        from grpo.workers.collector import SyncLLMCollector

        cfg, inference = self.cfg, self.cfg.inference
        num_workers = cfg.orchestration.num_inference_workers
        actor_cls = ray.remote(**_resources(inference, default_cpus=1))(SyncLLMCollector)
        self.collectors = [
            actor_cls.remote(
                worker_id=worker_id,
                num_workers=num_workers,
                model_dir=cfg.base_model_path,
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
            )
            for worker_id in range(num_workers)
        ]
        for worker_id, collector in enumerate(self.collectors):
            self._names[collector] = f"collector[{worker_id}]"
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
        batch_size = cfg.training.batch_size
        sync_every = cfg.training.steps_before_weight_sync
        eval_every = cfg.get("eval_every_n_steps") or 0
        stall_timeout_s = cfg.orchestration.get("stall_timeout_s", 600)
        inflight: dict[Any, tuple[str, int]] = {}

        def launch(kind: str, index: int, ref: Any) -> None:
            inflight[ref] = (kind, index)

        for index, collector in enumerate(self.collectors):
            launch("collector", index, collector.generate_batch.remote(cfg.inference.batch_size))
        for index, actor in enumerate(self.ref_actors):
            launch("ref", index, actor.step.remote())

        if evaluate is not None:
            self.state.eval_history.append((0, evaluate(0)))

        sample_ref = self.replay_buffer.sample.remote(batch_size, self.state.policy_version)
        launch("sample", 0, sample_ref)
        wait_start = time.perf_counter()
        train_refs: list[Any] = []
        last_progress = time.monotonic()

        while self.state.step < num_steps:
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            if not ready:
                if time.monotonic() - last_progress > stall_timeout_s:
                    raise ActorFailedError(
                        f"no actor made progress for {stall_timeout_s:.0f} s "
                        f"(in flight: {sorted(set(k for k, _ in inflight.values()))})"
                    )
                continue
            last_progress = time.monotonic()
            for ref in ready:
                kind, index = inflight.pop(ref)
                name = kind if kind in ("sample", "train") else f"{kind}[{index}]"
                try:
                    result = ray.get(ref)
                except (RayActorError, RayTaskError) as error:
                    actor = {"sample": "replay_buffer", "train": f"trainer[{index}]"}.get(kind, name)
                    raise ActorFailedError(f"{actor} failed: {error}") from error

                if kind == "collector":
                    collector = self.collectors[index]
                    self._log(result, self.state.step)
                    launch(kind, index, collector.generate_batch.remote(cfg.inference.batch_size))
                elif kind == "ref":
                    if result:
                        self._log(result["metrics"], self.state.step)
                        self.ledger.scored(self.state.step, result["sequence_ids"])
                    launch(kind, index, self.ref_actors[index].step.remote())
                elif kind == "sample":
                    if result is None:
                        time.sleep(0.05)
                        launch("sample", 0, self.replay_buffer.sample.remote(
                            batch_size, self.state.policy_version))
                        continue
                    waited = time.perf_counter() - wait_start
                    batch = result
                    debug_ids = None
                    if cfg.get("debug_logging_enabled") and self.tokenizer is not None:
                        count = cfg.get("debug_num_samples_per_step", 1)
                        debug_ids = [t.sequence_id for t in batch[:count]]
                    train_refs = [
                        t.train_step.remote(ref, waited, debug_ids) for t in self.trainers
                    ]
                    for rank, train_ref in enumerate(train_refs):
                        launch("train", rank, train_ref)
                elif kind == "train":
                    if any(r in inflight for r in train_refs):
                        continue  # wait for every rank
                    metrics = result if index == 0 else ray.get(train_refs[0])
                    self.ledger.trained(self.state.step + 1, batch)
                    self._after_train_step(metrics, batch, sync_every)
                    if evaluate is not None and eval_every and self.state.step % eval_every == 0:
                        self.state.eval_history.append((self.state.step, evaluate(self.state.step)))
                    if on_step is not None:
                        on_step(self.state)
                    if self.state.step < num_steps:
                        wait_start = time.perf_counter()
                        launch("sample", 0, self.replay_buffer.sample.remote(
                            batch_size, self.state.policy_version))

        if evaluate is not None and (not eval_every or num_steps % eval_every):
            self.state.eval_history.append((num_steps, evaluate(num_steps)))
        return self.state

    def _after_train_step(
        self, metrics: dict[str, Any], batch: list[Any], sync_every: int
    ) -> None:
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
        # Put once; every collector reads the same object. Applied between generation batches.
        weights_ref = ray.put(payload["weights"])
        for collector in self.collectors:
            collector.receive_weights.remote(
                weights_ref, payload["version"], payload["checksum"], payload["probe"]
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
        trainer_sums = self._get_all([t.weights_checksum.remote() for t in self.trainers],
                                     "trainer checksum")
        expected = trainer_sums[0]
        self._get_all([c.apply_pending_weights.remote() for c in self.collectors],
                      "collector weight update")
        got = self._get_all([c.get_weights_checksum.remote() for c in self.collectors],
                            "collector checksum")
        in_sync = all(checksum == expected for checksum in got)
        self._log({"weight_sync/in_sync": float(in_sync)}, self.state.step)
        if not in_sync:
            log.error("collector weights differ from the trainer's: %s vs %s", got, expected)
        return in_sync

    def save_final_checkpoint(self) -> Path:
        out_dir = self.run_dir / "final"
        self._get_all([t.save_hf_checkpoint.remote(str(out_dir)) for t in self.trainers],
                      "trainer checkpoint")
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
