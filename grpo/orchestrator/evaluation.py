"""Held-out evaluation: greedy accuracy on prompts the policy never trains on.

The collector's own vLLM engine generates (it always holds the latest synced weights), and
math-verify scores the completions, with the same timeout machinery as training rewards.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from grpo.config import RunConfig
from grpo.observability.metric_names import EVAL_ACCURACY, EVAL_NUM_EXAMPLES
from grpo.rewards import MathCorrectnessReward, batched_rewards


class HeldOutEvaluator:
    """Greedy accuracy of the current policy on a fixed held-out set.

    Args:
        items (list[dict]): Held-out examples (``question``, ``answer``).
        collector: A `SyncLLMCollector` actor handle (or local instance) with ``evaluate``.
        metric_logger: Metric logger actor handle, or None.
        max_generated_tokens (int): Generation budget per example.
        reward_timeout_s (float | None): Per-sample scoring timeout.

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
        reward_timeout_s: float | None = RunConfig.model_fields["reward_timeout_s"].default,
    ) -> None:
        if not items:
            raise ValueError("the evaluation set is empty")
        self.items = items
        self.collector = collector
        self.metric_logger = metric_logger
        self.max_generated_tokens = max_generated_tokens
        self.reward_timeout_s = reward_timeout_s
        self.correctness = MathCorrectnessReward(partial_credit=0.0)

    def __call__(self, step: int, collector: Any = None) -> dict[str, float]:
        """Evaluate now and log ``eval/*`` metrics at ``step``.

        Args:
            step (int): Training step the result belongs to.
            collector: Collector to generate with instead of the one given at construction
                (the orchestrator passes its current one: a dead collector is replaced).

        Returns:
            dict[str, float]: ``eval/accuracy``, ``eval/num_examples``, ``eval/time (s)``.
        """
        start = time.perf_counter()
        evaluate = (collector or self.collector).evaluate
        if hasattr(evaluate, "remote"):
            completions = ray.get(evaluate.remote(self.items, self.max_generated_tokens))
        else:
            completions = evaluate(self.items, self.max_generated_tokens)
        scores = batched_rewards(
            [self.correctness],
            completions,
            [item["answer"] for item in self.items],
            timeout_s=self.reward_timeout_s,
        )
        metrics = {
            EVAL_ACCURACY: float(scores.successes[:, 0].mean()),
            EVAL_NUM_EXAMPLES: float(len(self.items)),
            "eval/response_chars": sum(len(c) for c in completions) / len(completions),
            "eval/time (s)": time.perf_counter() - start,
        }
        if self.metric_logger is not None:
            self.metric_logger.log_dict.remote(metrics, step=step)
        return metrics
