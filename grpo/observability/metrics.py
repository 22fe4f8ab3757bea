"""Metric post-processing on the driver: the run ledger, step metrics and debug tables.

Owns nothing the run needs to continue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo.observability.metric_names import (
    REPLAY_BUFFER_DROPPED_STALE,
    REPLAY_BUFFER_SIZE,
    TRAIN_PERF_NAMESPACE,
    TRAIN_PERF_STEP_WALL_TIME,
    TRAIN_PERF_TIME_DRIVER_OVERHEAD,
    TRAIN_PERF_TIME_ENGINE_RELOAD,
    TRAIN_PERF_TIME_GENERATION_BUSY,
    TRAIN_PERF_TIME_GRPO_STEPS,
    TRAIN_PERF_TIME_SCORING_BUSY,
    TRAIN_PERF_TIME_TRAIN_COMPUTE,
    TRAIN_PERF_TIME_WAITING_BUFFER,
    TRAIN_PERF_TIME_WEIGHT_GATHER,
    TRAIN_PERF_TIME_WEIGHT_SYNC,
    TRAIN_PERF_TIME_WEIGHT_TRANSFER,
    TRAIN_PERF_TOTAL_STEP_TIME,
    ratio_metrics,
)

log = logging.getLogger("grpo")


def step_metrics(
    metrics: dict[str, Any], buffer_stats: dict[str, Any], queues: dict[str, float]
) -> dict[str, Any]:
    """A trainer's step metrics with the driver's queue sizes and each phase's share of time.

    Args:
        queues: More ``queues/*`` and driver values to log as they are.

    Returns:
        dict[str, Any]: A new dict with the queue numbers and ``pct_*`` shares added.
    """
    metrics = {
        **metrics,
        REPLAY_BUFFER_SIZE: float(buffer_stats["size"]),
        REPLAY_BUFFER_DROPPED_STALE: float(buffer_stats["dropped_stale"]),
        **queues,
    }
    total = metrics.get(TRAIN_PERF_TOTAL_STEP_TIME, 0.0)
    timings = {
        key: metrics[key]
        for key in (
            TRAIN_PERF_TIME_GRPO_STEPS,
            TRAIN_PERF_TIME_WAITING_BUFFER,
            TRAIN_PERF_TIME_WEIGHT_SYNC,
            TRAIN_PERF_TIME_WEIGHT_GATHER,
        )
        if key in metrics
    }
    if total > 0:
        metrics.update(ratio_metrics(TRAIN_PERF_NAMESPACE, timings, total))
    return metrics


# The parts that add up to `TRAIN_PERF_STEP_WALL_TIME`, in the order a step runs them.
WALL_PARTS = (
    TRAIN_PERF_TIME_WAITING_BUFFER,
    TRAIN_PERF_TIME_TRAIN_COMPUTE,
    TRAIN_PERF_TIME_WEIGHT_GATHER,
    TRAIN_PERF_TIME_WEIGHT_TRANSFER,
    TRAIN_PERF_TIME_ENGINE_RELOAD,
    TRAIN_PERF_TIME_DRIVER_OVERHEAD,
)


def step_time_breakdown(
    wall_s: float,
    buffer_wait_s: float,
    train_compute_s: float,
    sync_timings: dict[str, float],
    sync_wall_s: float,
    generation_busy_s: float,
    scoring_busy_s: float,
) -> dict[str, float]:
    """Split one training step's wall time into parts that add up to it.

    The parts (`WALL_PARTS`) do not overlap; driver overhead is the remainder. A sync that
    reports no transfer time gets the rest of its wall time as transfer. Generation and
    scoring busy times overlap training and are reported beside the parts, not in them.

    Args:
        wall_s: From waiting for the step's batch to its metrics being ready.
        train_compute_s: Seconds rank 0 spent in ``train_step``.
        sync_timings: What `WeightSync.sync` returned (empty if no sync).
        generation_busy_s, scoring_busy_s: Collectors' and reference actors' busy seconds
            finished during the step.

    Returns:
        dict[str, float]: `TRAIN_PERF_STEP_WALL_TIME`, every `WALL_PARTS` key,
        `TRAIN_PERF_TIME_GENERATION_BUSY` and `TRAIN_PERF_TIME_SCORING_BUSY`.
    """
    gather = sync_timings.get(TRAIN_PERF_TIME_WEIGHT_GATHER, 0.0)
    reload = sync_timings.get(TRAIN_PERF_TIME_ENGINE_RELOAD, 0.0)
    transfer = sync_timings.get(
        TRAIN_PERF_TIME_WEIGHT_TRANSFER, max(sync_wall_s - gather - reload, 0.0)
    )
    accounted = buffer_wait_s + train_compute_s + gather + transfer + reload
    return {
        TRAIN_PERF_STEP_WALL_TIME: wall_s,
        TRAIN_PERF_TIME_WAITING_BUFFER: buffer_wait_s,
        TRAIN_PERF_TIME_TRAIN_COMPUTE: train_compute_s,
        TRAIN_PERF_TIME_WEIGHT_GATHER: gather,
        TRAIN_PERF_TIME_WEIGHT_TRANSFER: transfer,
        TRAIN_PERF_TIME_ENGINE_RELOAD: reload,
        TRAIN_PERF_TIME_DRIVER_OVERHEAD: wall_s - accounted,
        TRAIN_PERF_TIME_GENERATION_BUSY: generation_busy_s,
        TRAIN_PERF_TIME_SCORING_BUSY: scoring_busy_s,
    }


class RunLedger:
    """Which sequences were scored and which were trained on, one JSON line per event.

    The proof that every trajectory was scored and trained on exactly once; each line is
    flushed, so it survives a crash.

    Writes ``scored.jsonl`` and ``trained.jsonl`` in ``run_dir``.
    """

    def __init__(self, run_dir: Path) -> None:
        self.scored_file = open(run_dir / "scored.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.trained_file = open(run_dir / "trained.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    @staticmethod
    def _write(file: Any, record: dict[str, Any]) -> None:
        file.write(json.dumps(record) + "\n")
        file.flush()

    def scored(self, step: int, sequence_ids: list[str], dropped: Sequence[str] = ()) -> None:
        """Record a reference call's sequences.

        Args:
            sequence_ids: Every sequence it scored, dropped ones included (so a gap in the ids
                still means a lost group).
            dropped: Those dropped for equal rewards: never trained on.
        """
        self._write(
            self.scored_file,
            {"step": step, "sequence_ids": sequence_ids, "dropped_sequence_ids": list(dropped)},
        )

    def trained(self, step: int, summary: dict[str, Any]) -> None:
        """Record a trained batch from its summary (`ReplayBufferActor.sample_batch`)."""
        self._write(
            self.trained_file,
            {
                "step": step,
                "sequence_ids": summary["sequence_ids"],
                "group_ids": summary["group_ids"],
                "policy_versions": summary["policy_versions"],
            },
        )

    def rewound(self, step: int, from_step: int) -> None:
        """Record that the run went back from ``from_step`` to the checkpoint of ``step``."""
        record = {"rewound_to": step, "from_step": from_step}
        self._write(self.scored_file, record)
        self._write(self.trained_file, record)

    def close(self) -> None:
        self.scored_file.close()
        self.trained_file.close()


def records_after_rewinds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of ``trained.jsonl`` (or ``metrics.jsonl``) that the final weights stand on.

    A record with ``rewound_to`` drops the earlier records of every later step: those steps
    were redone.

    Returns:
        list[dict]: The step records that stand, in order, markers left out.
    """
    kept: list[dict[str, Any]] = []
    for record in records:
        if "rewound_to" in record:
            kept = [r for r in kept if r["step"] <= record["rewound_to"]]
        else:
            kept.append(record)
    return kept


def debug_tables(
    batch: list[Any], pi_logprobs: dict[str, list[float]], tokenizer: Any, step: int
) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """Per-sample and per-token debug tables of the sequences in ``pi_logprobs``.

    Args:
        pi_logprobs: Policy logprobs by ``sequence_id``.

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
            "Advantage": _mean_advantage(traj),
            "Response Length": traj.response_len,
            # Below Response Length for multi-turn episodes: the rest is environment turns.
            "Trained Tokens": traj.policy_len,
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
        generated = traj.logprobs.tolist()
        advantages = traj.token_advantages.tolist()
        ref = traj.ref_logprobs.tolist() if traj.ref_logprobs is not None else None
        trained = (
            traj.response_mask.tolist()
            if traj.response_mask is not None
            else [True] * traj.response_len
        )
        for position, token_id in enumerate(traj.response_tokens.tolist()):
            token = {
                "Sequence ID": traj.sequence_id,
                "Token Position": position,
                "Token ID": token_id,
                "Decoded Token": tokenizer.decode([token_id], skip_special_tokens=False),
                # An "env" token's generated logprob is a 0 placeholder.
                "Source": "policy" if trained[position] else "env",
                "Advantage": advantages[position],
                "Generated Logprob": generated[position],
                "Ref Logprob": ref[position] if ref is not None else None,
                "Pi Logprob": pi[position],
                "Abs Diff Pi-Ref": abs(pi[position] - ref[position]) if ref is not None else None,
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


def _mean_advantage(traj: Any) -> float:
    """A trajectory's advantage, or the mean of its per-token ones over the trained tokens."""
    if traj.advantages.dim() == 0:
        return float(traj.advantages)
    trained = traj.token_advantages
    if traj.response_mask is not None:
        trained = trained[traj.response_mask]
    return float(trained.mean()) if trained.numel() else 0.0
