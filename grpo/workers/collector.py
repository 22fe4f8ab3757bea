"""The generation actor: a vLLM engine playing the environment's episodes on its shard of the
prompts, scoring them and queueing the groups (blocking and bounded: a group is never dropped).

Contracts other actors rely on: prompts reach vLLM as token ids of the model folder's tokenizer
and what the policy sampled is never re-tokenised; a response keeps the token that ended it;
behaviour logprobs are after temperature. ``sequence_id`` (``w{worker_id}-{n}``) and
``group_id`` (``worker_id + num_workers * k``) are unique with no coordination, and a group's
seed hashes the run seed and its ``group_id``, so a resumed stream samples exactly the same.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from grpo.config.sections import REWARD_TIMEOUT_S, InferenceConfig, LoRAConfig
from grpo.data.dataset import resolve_dataset
from grpo.envs.build import build_environment
from grpo.envs.dropped import BatchDrops, DroppedEpisodeLog, scored_episodes
from grpo.envs.evaluation import EvaluationEnvironment, evaluation_episodes
from grpo.envs.metrics import episode_metrics, generation_metrics
from grpo.envs.protocol import EngineContext, Prompt
from grpo.envs.rollout import episode_groups
from grpo.observability import metric_names as names
from grpo.seeds import group_seed
from grpo.types import GroupedUnscoredTrajectories, GroupRecord
from grpo.weights.adapter import MergedAdapters, engine_adapters, serves_merged
from grpo.weights.concurrency import COLLECTOR_CONCURRENCY_GROUPS
from grpo.workers.engine_sleep import SleepMethods
from grpo.workers.rollout_queue import put_all
from grpo.workers.vllm_engine import EngineLoop, Sampling, VersionRuns, build_engine

log = logging.getLogger(__name__)


def _start_scoring(environment: Any) -> None:
    """`Environment.start_scoring`, on the thread that runs it: a failure is only logged (the
    first batch's scoring starts the workers again, and raises what stops it)."""
    try:
        environment.start_scoring()
    except Exception as error:
        log.warning("starting the reward workers early failed: %s", error)


class SyncLLMCollector(SleepMethods):
    """Plays the environment's episodes with vLLM on one shard of a prompt dataset.

    Args:
        worker_id: Index of this collector, in ``[0, num_workers)``.
        num_workers: Number of collectors sharing the dataset.
        model_dir: Hugging Face model folder (weights, config, tokenizer files).
        dataset: A sequence of examples, a ``_component_`` node, or None when the environment
            brings its own.
        rollout_queue: Anything with ``put(item, block=True, timeout=...)`` raising
            ``queue.Full`` on timeout.
        config: The ``inference:`` options; None: their defaults.
        seed: Seeds the prompt order and every request's sampler.
        policy_version: The version of the weights in ``model_dir``.
        verify_weights: Check the checksum of every received update.
        environment: An `grpo.envs.Environment` or its node; None: the single-turn
            environment of ``reward_functions``.
        reward_functions: The run's reward functions (nodes or objects).
        reward_timeout_s: Timeout of one reward call.
        lora: ``training.lora``: updates are LoRA adapters on the base model, served as vLLM
            LoRA adapters or merged into the base weights (``lora.serve``).
        adapter_dir: With ``lora``, the adapter of ``policy_version``; None: the base model.

    Raises:
        ValueError: On inconsistent sizes (worker id out of range, an empty shard, no room
            for a prompt in ``max_model_len``).
    """

    def __init__(
        self,
        worker_id: int,
        num_workers: int,
        model_dir: str | os.PathLike,
        dataset: Any,
        rollout_queue: Any,
        config: InferenceConfig | None = None,
        *,
        seed: int = 0,
        policy_version: int = 0,
        verify_weights: bool = True,
        environment: Any = None,
        reward_functions: Sequence[Any] = (),
        reward_timeout_s: float = REWARD_TIMEOUT_S,
        lora: LoRAConfig | None = None,
        adapter_dir: str | None = None,
    ) -> None:
        from grpo.data.stream import PromptStream
        from grpo.models import load_tokenizer

        config = config or InferenceConfig()
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.model_dir = str(model_dir)
        self.group_size = config.group_size
        self.max_generated_tokens = config.max_generated_tokens
        self.rollout_queue = rollout_queue
        self.seed = seed
        self.queue_put_timeout_s = float(config.queue_put_timeout_s)
        self.weight_check_every_n_batches = config.weight_check_every_n_batches

        self.environment = build_environment(environment, reward_functions, reward_timeout_s)
        # The reward workers start (a process that imports torch, then the workers) beside the
        # engine's build, not in the first batch's scoring, which would wait for them.
        threading.Thread(
            target=_start_scoring, args=(self.environment,), name="start-scoring", daemon=True
        ).start()
        if dataset is None:  # the environment's own rows (a verifiers taskset)
            dataset = self.environment.examples()
        self.dataset = resolve_dataset(dataset)
        self.stream = PromptStream(self.dataset, worker_id, num_workers, seed=seed)
        self.tokenizer = load_tokenizer(self.model_dir)
        prompt_template = getattr(self.dataset, "template", None)
        self.sampling = Sampling(
            temperature=float(config.temperature),
            top_p=float(config.top_p),
            stop=tuple(getattr(prompt_template, "stop", ())),
            stop_token_ids=tuple(self.tokenizer.stop_tokens),
        )
        response_tokens = self.environment.response_budget(self.max_generated_tokens)
        # training.lora.serve: merged, the engine runs without LoRA on base + adapter weights.
        merged = (
            MergedAdapters(self.model_dir, lora, verify_weights)
            if lora and serves_merged(lora)
            else None
        )
        lora_rank = lora.rank if lora and merged is None else None
        llm, self.max_model_len, self.max_prompt_tokens, eager_on_cpu = build_engine(
            self.model_dir, config, seed, response_tokens, lora_rank
        )
        if merged is not None:
            merged.start(llm, adapter_dir, policy_version)
        self.engine = EngineLoop(
            llm,
            self.sampling,
            config.weight_updates,
            owner=f"inference[{worker_id}]",
            model_dir=self.model_dir,
            policy_version=policy_version,
            verify=verify_weights,
            adapters=engine_adapters(
                llm, lora if merged is None else None, self.model_dir, adapter_dir, policy_version
            ),
            merged=merged,
            sleep_while_training=config.sleep_while_training,
            dynamo_off=eager_on_cpu,
        )
        self.weights = self.engine.weights
        self.environment.start(
            EngineContext(
                model_dir=self.model_dir,
                tokenizer=self.tokenizer,
                max_model_len=self.max_model_len,
                max_tokens_per_turn=self.max_generated_tokens,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                prompt_template=prompt_template,
            )
        )
        # Held-out evaluation's own instance of the environment (built on first use).
        spec = (environment, reward_functions, reward_timeout_s)
        self.evaluation_env = EvaluationEnvironment(*spec, self.environment)
        self.sequence_counter = 0
        self.group_counter = 0
        self.batch_counter = 0
        self.totals: MutableMapping[str, float] = ChainMap(
            {"queue_put_waits": 0.0, "skipped_long_prompts": 0.0, "episodes_dropped": 0.0},
            self.weights.totals,
        )
        self.dropped_episodes = DroppedEpisodeLog(f"inference[{worker_id}]")
        self._batch_drops: BatchDrops | None = None
        self._batch_records: list[GroupRecord] = []
        self._put_waiting_since: float | None = None

    @classmethod
    def as_remote(cls, **options: Any) -> Any:
        """This class as a threaded Ray actor class.

        Threads let `evaluate` through while a batch waits on a full rollout queue; weight
        transfers and `heartbeat` run in their own concurrency groups.

        Args:
            **options: ``ray.remote`` options; ``max_concurrency`` defaults to 4.
        """
        import ray

        defaults = {"max_concurrency": 4, "concurrency_groups": COLLECTOR_CONCURRENCY_GROUPS}
        return ray.remote(**{**defaults, **options})(cls)

    def heartbeat(self) -> dict[str, float]:
        """For the driver's stall watch, without a lock (call it in the ``health`` group): how
        long the engine step now running has run (``in_engine_step_s``), ``engine_steps`` so
        far, and how long the batch has waited for room on the queue (``queue_wait_s``)."""
        now, waiting = time.monotonic(), self._put_waiting_since
        return {
            "in_engine_step_s": self.engine.step_running_s(now),
            "engine_steps": float(self.engine.steps),
            "queue_wait_s": now - waiting if waiting is not None else 0.0,
        }

    def receive_weights(
        self,
        weights: Any,
        version: int,
        checksum: str | None = None,
        probe: dict[str, Any] | None = None,
        transport: str = "object_store",
        connection: Any = None,
    ) -> bool:
        """Receive weights; they load between two engine steps or before the next batch."""
        return self.weights.receive(weights, version, checksum, probe, transport, connection)

    def apply_pending_weights(self) -> float:
        """Load pending weights now (a sleeping engine wakes first); the seconds it took."""
        return self.engine.apply_pending()

    def get_weights_checksum(self) -> str | None:
        """`state_dict_checksum` of the weights the engine was last loaded with."""
        return self.weights.checksum()

    def get_policy_version(self) -> int:
        """Version of the verified weights the engine holds (what samples are labelled with)."""
        return self.weights.policy_version

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The engine's logprob of every token of ``token_ids`` after the first."""
        return self.weights.probe_logprobs(token_ids)

    policy_version = property(lambda self: self.weights.policy_version)

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` (None once shut down)."""
        return self.engine.llm

    def _next_sequence_id(self) -> str:
        """``w{worker_id}-{n}``: unique across workers, in generation order."""
        sequence_id = f"w{self.worker_id}-{self.sequence_counter}"
        self.sequence_counter += 1
        return sequence_id

    def _run_episodes(
        self,
        prompts: list[Prompt],
        group_ids: list[int],
        sequence_ids: list[list[str]] | None = None,
    ) -> tuple[list[GroupedUnscoredTrajectories], dict[str, float], VersionRuns]:
        """The environment's episodes for ``prompts``, scored, as groups; their metrics, and
        the ``(version, tokens)`` runs of each kept episode's policy tokens.

        ``sequence_ids``: per group, the ids its trajectories take (a regenerated group's);
        None takes new ones.
        """
        first_version = self.policy_version  # weights may change while the episodes run
        # Episode j of a group samples its first turn with seed + j (`grpo.seeds`).
        seeds = [group_seed(self.seed, group_id) for group_id in group_ids]
        with self.engine.batch():  # the turns are in the engine until the batch ends
            episodes = self.environment.run_groups(
                prompts, self.engine.turn_engine(), self.group_size, seeds
            )
        every = [e for group in episodes for e in group]
        # Failed episodes stay in their groups with the failure rewards, or are left out
        # (the environment's failed_episodes).
        kept, rewards = scored_episodes(self.environment, every)
        next_id = self._next_sequence_id
        if sequence_ids is not None:
            given: list[str] = []
            for group, ids in zip(episodes, sequence_ids):
                count = sum(e.error is None or e.failure_scored for e in group)
                given += ids[:count]
                given += [self._next_sequence_id() for _ in range(count - len(ids))]
            next_id = iter(given).__next__
        self._batch_drops = self.dropped_episodes.record(every, type(self.environment).__name__)
        self.totals["episodes_dropped"] += (dropped := len(every) - len(kept))
        groups = episode_groups(
            episodes, rewards, group_ids=group_ids, sequence_id=next_id,
            policy_version=first_version, last_policy_version=self.policy_version,
        )  # fmt: skip
        metrics = episode_metrics(kept, dropped, self.totals["episodes_dropped"])
        runs = [e.version_runs or [(first_version, sum(e.turn_lengths))] for e in kept]
        return groups, {**metrics, **self.environment.batch_metrics()}, runs

    def _put_groups(self, groups: list[GroupedUnscoredTrajectories], put: dict[str, float]) -> None:
        """Blocking puts of ``groups`` in order, retried on timeout until all are queued;
        ``put`` counts them (right even when a put raises), the timeouts and the time spent."""
        if self.rollout_queue is None:
            raise RuntimeError(f"inference[{self.worker_id}] has no rollout_queue to put groups on")
        start = time.perf_counter()
        self._put_waiting_since = time.monotonic()
        try:
            while (queued := int(put["queued"])) < len(groups):
                put["queued"] += put_all(
                    self.rollout_queue, groups[queued:], self.queue_put_timeout_s
                )
                if put["queued"] < len(groups):
                    put["waits"] += 1
                    self.totals["queue_put_waits"] += 1
        finally:
            self._put_waiting_since = None
            put["wait_s"] += time.perf_counter() - start

    def generate_batch(
        self, num_prompts: int, *, tolerate_dead_queue: bool = False
    ) -> dict[str, float]:
        """Apply pending weights, play ``group_size`` episodes of the next prompts, queue them.

        Args:
            num_prompts: Prompts to take from the shard (one group each).
            tolerate_dead_queue: The caller generates again what a dead queue lost, so a dead
                queue is no error.

        Returns:
            dict[str, float]: This batch's ``inference/*`` and ``queues/*`` metrics.

        Raises:
            ValueError: If ``num_prompts`` is below 1.
            WeightSyncError: If pending weights fail verification.
            RayActorError: The queue died (after the metrics count the groups not queued).
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        prompts, skipped = self.stream.next_fitting(
            num_prompts, self.environment.prompt_ids, self.max_prompt_tokens
        )
        self.totals["skipped_long_prompts"] += skipped
        group_ids = [
            self.worker_id + self.num_workers * (self.group_counter + i) for i in range(num_prompts)
        ]
        self.group_counter += num_prompts
        metrics = self._generate(prompts, group_ids, None, tolerate_dead_queue)
        self.batch_counter += 1
        return metrics

    def _generate(
        self,
        prompts: list[Prompt],
        group_ids: list[int],
        sequence_ids: list[list[str]] | None,
        tolerate_dead_queue: bool,
    ) -> dict[str, float]:
        check = self.engine.in_flight or self.batch_counter % self.weight_check_every_n_batches == 0
        weight_update_s = self.apply_pending_weights() if check else 0.0
        self.weights.start_batch()
        start = time.perf_counter()
        groups, episode_metrics, runs = self._run_episodes(prompts, group_ids, sequence_ids)
        generation_s = time.perf_counter() - start
        prompt_of = dict(zip(group_ids, prompts))
        self._batch_records = [
            GroupRecord(
                group.group_id,
                prompt_of[group.group_id],
                [t.sequence_id for t in group.trajectories],
                max(t.policy_version for t in group.trajectories),
            )
            for group in groups
        ]
        put = {"waits": 0.0, "wait_s": 0.0, "queued": 0.0}
        try:
            self._put_groups(groups, put)
        except Exception as error:
            from ray.exceptions import RayActorError  # the queue died

            if not (tolerate_dead_queue and isinstance(error, RayActorError)):
                raise
        finally:
            queued = int(put["queued"])
            metrics = {
                "inference/worker_id": float(self.worker_id),
                names.INFERENCE_POLICY_VERSION: float(self.policy_version),
                "inference/num_groups": float(queued),
                names.INFERENCE_GROUPS_NOT_QUEUED: float(len(groups) - queued),
                **generation_metrics(groups, generation_s, episode_metrics),
                names.INFERENCE_TIME_WEIGHT_UPDATE: weight_update_s,
                "inference/skipped_long_prompts": self.totals["skipped_long_prompts"],
                **self.weights.batch_metrics(runs),
                names.ROLLOUT_QUEUE_PUT_WAIT_S: put["wait_s"],
                "queues/rollout_queue_put_waits": put["waits"],
                **episode_metrics,
            }
            if (lost := len(groups) - queued) > 0:
                log.warning(
                    "inference[%d]: %d groups not queued: a put failed", self.worker_id, lost
                )
        return metrics

    def generate_batch_with_state(
        self, num_prompts: int, rollout_queue: Any = None
    ) -> dict[str, Any]:
        """`generate_batch` onto ``rollout_queue`` (None: the last one given), then what the
        driver keeps of it: the collector's state right after it and the groups' records.

        The driver holds no copy of the groups: what a dead queue lost is generated again from
        the records (`regenerate`), so a dead queue is no error here.

        Returns:
            dict: ``{"metrics", "state", "records", "dropped_episodes", "reward_calls"}``.
        """
        # No engine lock: it would block `evaluate` while the batch waits on a full queue.
        if rollout_queue is not None:
            self.rollout_queue = rollout_queue
        self._batch_drops = None
        metrics = self.generate_batch(num_prompts, tolerate_dead_queue=True)
        return self._batch_info(metrics)

    def regenerate(self, records: list[GroupRecord], rollout_queue: Any) -> dict[str, Any]:
        """Generate lost groups again, under their group and sequence ids, onto the queue.

        Their trajectories are sampled anew (group ids fix the seeds, the weights are the
        current ones). The stream does not move.

        Returns:
            dict: As `generate_batch_with_state`.
        """
        self.rollout_queue = rollout_queue
        self._batch_drops = None
        prompts = [record.prompt for record in records]
        group_ids = [record.group_id for record in records]
        sequence_ids = [record.sequence_ids for record in records]
        metrics = self._generate(prompts, group_ids, sequence_ids, tolerate_dead_queue=True)
        return self._batch_info(metrics)

    def _batch_info(self, metrics: dict[str, float]) -> dict[str, Any]:
        drops = self._batch_drops
        return {
            "metrics": metrics,
            "state": self.state_dict(),
            "records": self._batch_records,
            "dropped_episodes": drops.as_dict() if drops is not None else None,
            "reward_calls": self.environment.take_reward_calls(),
        }

    def shutdown(self) -> None:
        """Close the environment and shut the engine down now (idempotent).

        In-process engines share vLLM's global state, which one collected by the garbage
        collector tears down under the others: close several explicitly, last created first.
        """
        self.evaluation_env.close()
        self.environment.close()
        self.engine.shutdown()

    def evaluate(
        self, dataset_items: Sequence[Mapping[str, Any]], max_generated_tokens: int | None = None
    ) -> list[str]:
        """Per example, the last policy turn of its greedy episode, decoded (``""`` for a prompt
        that does not fit or a failed episode)."""
        results = self.evaluate_episodes(dataset_items, 1, 0.0, max_generated_tokens)
        return [result["samples"][0]["text"] for result in results]

    def evaluate_episodes(
        self,
        dataset_items: Sequence[Mapping[str, Any]],
        samples_per_example: int = 1,
        temperature: float = 0.0,
        max_generated_tokens: int | None = None,
    ) -> list[dict[str, Any]]:
        """Held-out episodes on the current weights, scored on an environment instance of their
        own: training's counts, metrics and stream are untouched.

        Args:
            dataset_items: Examples with ``"prompt"``.
            samples_per_example: Episodes per example.
            temperature: Sampling temperature (0: greedy).
            max_generated_tokens: Most tokens of one turn (default the run's).

        Returns:
            list[dict]: Per example, its samples.

        Raises:
            ValueError: For an environment with its own tasks (a verifiers taskset).
        """
        env = self.evaluation_env.get()
        self.apply_pending_weights()
        prompt_ids = [env.prompt_ids(item) for item in dataset_items]
        fitting = [ids if len(ids) < self.max_model_len else None for ids in prompt_ids]
        if too_long := fitting.count(None):
            log.warning("inference[%d]: %d evaluation prompts do not fit", self.worker_id, too_long)
        engine = self.engine.turn_engine(max_tokens=max_generated_tokens, temperature=temperature)
        return evaluation_episodes(
            env, engine, dataset_items, fitting, samples_per_example, self.seed, self.engine.batch
        )

    def state_dict(self) -> dict[str, Any]:
        """Stream position, id counters and policy version, for an exact resume."""
        return {
            "worker_id": self.worker_id,
            "num_workers": self.num_workers,
            "stream": self.stream.state_dict(),
            "sequence_counter": self.sequence_counter,
            "group_counter": self.group_counter,
            "batch_counter": self.batch_counter,
            "policy_version": self.policy_version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`): stream position and id counters.

        ``policy_version`` is not restored: it belongs to the weights the engine holds.

        Raises:
            ValueError: If the state belongs to another worker layout.
        """
        for key in ("worker_id", "num_workers"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"collector state has {key}={state[key]!r} but this collector has "
                    f"{key}={getattr(self, key)!r}"
                )
        self.stream.load_state_dict(state["stream"])
        self.sequence_counter = int(state["sequence_counter"])
        self.group_counter = int(state["group_counter"])
        self.batch_counter = int(state.get("batch_counter", 0))
