"""Metric post-processing on the driver: the run ledger, step metrics and debug tables.

Owns nothing the run needs to continue: `RunLedger` writes which sequences were scored and
trained (the proof that each was trained once), `step_metrics` adds the driver's queue
numbers and time shares to a trainer's step metrics, `debug_tables` decodes trained samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.metric_names import ratio_metrics


def step_metrics(
    metrics: dict[str, Any], buffer_stats: dict[str, Any], queues: dict[str, float]
) -> dict[str, Any]:
    """A trainer's step metrics with the driver's queue sizes and each phase's share of time.

    Args:
        metrics (dict[str, Any]): The trainer's step metrics (weight sync timings included).
        buffer_stats (dict[str, Any]): `ReplayBuffer.stats()`.
        queues (dict[str, float]): More ``queues/*`` and driver values to log as they are.

    Returns:
        dict[str, Any]: A new dict with the queue numbers and ``pct_*`` shares added.
    """
    metrics = {
        **metrics,
        "queues/train_replay_buffer_size": float(buffer_stats["size"]),
        "queues/replay_buffer_dropped_stale": float(buffer_stats["dropped_stale"]),
        **queues,
    }
    total = metrics.get("train_actor_performance/total_step_time (s)", 0.0)
    timings = {
        name: metrics[f"train_actor_performance/{name}"]
        for name in (
            "time_grpo_steps (s)",
            "time_waiting_buffer (s)",
            "time_weight_sync (s)",
            "time_weight_gather (s)",
        )
        if f"train_actor_performance/{name}" in metrics
    }
    if total > 0:
        metrics.update(ratio_metrics("train_actor_performance", timings, total))
    return metrics


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
