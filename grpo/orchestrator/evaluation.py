"""Held-out evaluation: the policy on examples it never trains on, scored as training scores.

The collector's own vLLM engine plays the episodes (it always holds the latest synced weights)
through the environment protocol, on an environment instance of their own, and the
environment's own rewards score them (`grpo.envs.evaluation`). This module turns the samples
into metrics:

* ``eval/accuracy``: the mean success of the first reward function over every sample (the
  correctness reward of a math run; with one greedy sample per example, the share of examples
  solved). An environment that scores without reward functions counts a reward above 0 as a
  success.
* ``eval/avg@k`` and ``eval/pass@k`` over ``k = eval_samples_per_example`` samples of each
  example: the mean share of successful samples, and the unbiased estimator of the Codex paper,
  ``pass@k = mean over examples of 1 - C(n - c, k) / C(n, k)`` with ``n`` samples of which ``c``
  succeed (here ``n = k``: the share of examples with at least one success). Per task too
  (``eval/task_<task>/...``) when examples have a ``task`` column.
* ``eval/reward_<name>_mean`` and ``eval/success_<name>_mean`` per reward, the mean response
  length in policy tokens, and the episodes the environment failed (each a sample with no
  reward and no success).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from grpo.observability import metric_names as names


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one example: ``1 - C(n - c, k) / C(n, k)``.

    The probability that ``k`` of the ``n`` samples, drawn without replacement, hold at least
    one of the ``c`` successful ones.

    Args:
        n (int): Samples of the example.
        c (int): Of them, the successful ones.
        k (int): Samples drawn (``k <= n``).

    Returns:
        float: The estimate, in [0, 1].

    Raises:
        ValueError: Unless ``0 <= c <= n`` and ``1 <= k <= n``.

    Example:
        >>> pass_at_k(4, 1, 2)
        0.5
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluation_metrics(results: Sequence[Mapping[str, Any]], k: int) -> dict[str, float]:
    """Metrics of evaluated examples (`grpo.envs.evaluation.evaluation_episodes`'s results).

    Args:
        results (Sequence[Mapping]): Per example, ``task`` and its ``samples``.
        k (int): The k of avg@k and pass@k (at most each example's number of samples).

    Returns:
        dict[str, float]: The ``eval/*`` metrics described in this module's docstring.

    Raises:
        ValueError: If there are no results.
    """
    if not results:
        raise ValueError("no evaluated examples")
    samples = [sample for result in results for sample in result["samples"]]
    reward_names: list[str] = []
    for sample in samples:
        reward_names += [name for name in sample["rewards"] if name not in reward_names]
    first = reward_names[0] if reward_names else None

    def successes(result: Mapping[str, Any]) -> list[float]:
        return [float(s["successes"].get(first, 0.0)) for s in result["samples"]]

    def at_k(group: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
        avg = [sum(successes(r)) / len(r["samples"]) for r in group]
        passed = [
            pass_at_k(len(r["samples"]), int(sum(x > 0 for x in successes(r))), k) for r in group
        ]
        return sum(avg) / len(avg), sum(passed) / len(passed)

    avg, passed = at_k(results)
    completed = [sample for sample in samples if not sample["failed"]]
    metrics = {
        names.EVAL_ACCURACY: sum(sum(successes(r)) for r in results) / len(samples),
        names.EVAL_AVG_AT_K_TEMPLATE.format(k=k): avg,
        names.EVAL_PASS_AT_K_TEMPLATE.format(k=k): passed,
        names.EVAL_NUM_EXAMPLES: float(len(results)),
        names.EVAL_SAMPLES_PER_EXAMPLE: float(k),
        names.EVAL_RESPONSE_TOKENS_MEAN: (
            sum(s["response_tokens"] for s in completed) / len(completed) if completed else 0.0
        ),
        names.EVAL_FAILED_EPISODES: float(len(samples) - len(completed)),
    }
    for name in reward_names:
        metrics[names.EVAL_REWARD_MEAN_TEMPLATE.format(name=name)] = sum(
            s["rewards"].get(name, 0.0) for s in samples
        ) / len(samples)
        metrics[names.EVAL_SUCCESS_MEAN_TEMPLATE.format(name=name)] = sum(
            s["successes"].get(name, 0.0) for s in samples
        ) / len(samples)
    tasks = sorted({r["task"] for r in results if r["task"] is not None})
    for task in tasks:
        task_avg, task_pass = at_k([r for r in results if r["task"] == task])
        metrics[names.EVAL_TASK_AVG_AT_K_TEMPLATE.format(task=task, k=k)] = task_avg
        metrics[names.EVAL_TASK_PASS_AT_K_TEMPLATE.format(task=task, k=k)] = task_pass
    return metrics


class HeldOutEvaluator:
    """The current policy on a fixed held-out set, through the environment protocol.

    Args:
        items (list[dict]): Held-out examples (with ``prompt``).
        collector: A `SyncLLMCollector` actor handle (or local instance) with
            ``evaluate_episodes``.
        metric_logger: Metric logger actor handle, or None.
        max_generated_tokens (int): Generation budget per turn.
        samples_per_example (int): Episodes per example (the k of avg@k and pass@k).
        temperature (float): Sampling temperature (0: greedy).

    Example:
        >>> evaluator = HeldOutEvaluator(items, collector, logger, max_generated_tokens=16)
        >>> evaluator(step=0)["eval/accuracy"]
        0.31
    """

    def __init__(
        self,
        items: list[dict[str, Any]],
        collector: Any,
        metric_logger: Any = None,
        max_generated_tokens: int = 32,
        samples_per_example: int = 1,
        temperature: float = 0.0,
    ) -> None:
        if not items:
            raise ValueError("the evaluation set is empty")
        self.items = items
        self.collector = collector
        self.metric_logger = metric_logger
        self.max_generated_tokens = max_generated_tokens
        self.samples_per_example = samples_per_example
        self.temperature = temperature
        # The last evaluation's per-example samples (`grpo eval` writes them to eval.json).
        self.results: list[dict[str, Any]] = []

    def __call__(self, step: int, collector: Any = None) -> dict[str, float]:
        """Evaluate now and log ``eval/*`` metrics at ``step``.

        Args:
            step (int): Training step the result belongs to.
            collector: Collector to generate with instead of the one given at construction
                (the orchestrator passes its current one: a dead collector is replaced).

        Returns:
            dict[str, float]: The ``eval/*`` metrics (`evaluation_metrics`) and
            ``eval/time (s)``.
        """
        start = time.perf_counter()
        evaluate = (collector or self.collector).evaluate_episodes
        args = (self.items, self.samples_per_example, self.temperature, self.max_generated_tokens)
        if hasattr(evaluate, "remote"):
            self.results = ray.get(evaluate.remote(*args))
        else:
            self.results = evaluate(*args)
        metrics = evaluation_metrics(self.results, self.samples_per_example)
        metrics[names.EVAL_TIME] = time.perf_counter() - start
        if self.metric_logger is not None:
            self.metric_logger.log_dict.remote(metrics, step=step)
        return metrics


def evaluate_policy(
    cfg: Any, checkpoint: str | None = None
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Evaluate a policy folder on the config's held-out set, without training.

    One collector runs in this process (no Ray cluster, no trainer, no reference model) and
    evaluates as the training loop does (`HeldOutEvaluator`).

    Args:
        cfg (RunConfig): The run config (its ``eval_*`` keys, environment and rewards).
        checkpoint (str | None): A model folder (a checkpoint, ``final/``); with
            ``training.lora``, a checkpoint's adapter served on ``base_model_path``; None: the
            base model.

    Returns:
        tuple: The ``eval/*`` metrics, and per example its samples.

    Raises:
        ValueError: If the config has no ``eval_dataset`` (and its environment no held-out rows
            of its own) or it has no example.
    """
    from grpo.config import instantiate
    from grpo.workers.collector import SyncLLMCollector

    if cfg.eval_dataset is not None:
        dataset = instantiate(cfg.eval_dataset, _key_="eval_dataset")
    else:  # an environment with its own held-out rows (`Environment.eval_examples`)
        from grpo.envs import build_environment

        environment = build_environment(cfg.environment, cfg.reward_functions, cfg.reward_timeout_s)
        dataset = environment.eval_examples()
        environment.close()
        if dataset is None:
            raise ValueError("eval_dataset: null; there is no held-out set to evaluate on")
    limit = min(cfg.eval_num_examples or len(dataset), len(dataset))
    if limit == 0:
        raise ValueError("eval_dataset: no usable examples")
    lora = cfg.training.lora
    model_dir = str(checkpoint) if checkpoint and lora is None else cfg.base_model_path
    collector = SyncLLMCollector(
        0,
        1,
        model_dir,
        dataset,
        None,
        cfg.inference,
        seed=cfg.seed,
        environment=cfg.environment,
        reward_functions=cfg.reward_functions,
        reward_timeout_s=cfg.reward_timeout_s,
        lora=lora,
        adapter_dir=str(checkpoint) if checkpoint and lora is not None else None,
    )
    try:
        evaluator = HeldOutEvaluator(
            [dataset[i] for i in range(limit)],
            collector,
            max_generated_tokens=cfg.inference.max_generated_tokens,
            samples_per_example=cfg.eval_samples_per_example,
            temperature=cfg.eval_temperature,
        )
        metrics = evaluator(step=0)
    finally:
        collector.shutdown()
    return metrics, evaluator.results


_COUNTS = (names.EVAL_NUM_EXAMPLES, names.EVAL_SAMPLES_PER_EXAMPLE, names.EVAL_FAILED_EPISODES)


def format_evaluation(metrics: Mapping[str, float]) -> str:
    """The metrics as a two-column table for the terminal, in their order."""
    width = max(len("METRIC"), *(len(name) for name in metrics)) + 2
    lines = [f"{'METRIC':<{width}}VALUE"]
    for name, value in metrics.items():
        shown = f"{value:.0f}" if name in _COUNTS else f"{value:.4f}"
        lines.append(f"{name:<{width}}{shown}")
    return "\n".join(lines)
