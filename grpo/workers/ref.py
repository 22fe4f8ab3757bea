"""The reference actor: reference logprobs, group advantages and the teacher's signal.

`score` gets whole groups from the driver and returns them scored, grouped as they came. The
driver owns both, so the actor holds no trajectory between calls and its replacement after a
crash scores the same groups. With ``ref.filter_zero_variance_groups`` groups whose rewards
are all equal are left out (docs/data-and-rewards.md); with ``ref.teacher_model_path`` each
token's advantage adds the teacher's signal (docs/training.md).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from grpo.config.sections import RefConfig
from grpo.objective.advantages import (
    distillation_advantages,
    group_advantages,
    teacher_signal,
    zero_variance_groups,
)
from grpo.observability import metric_names as names
from grpo.rewards.batch import env_reward_batch
from grpo.types import GroupedUnscoredTrajectories, ScoredTrajectory


class RefActor:
    """Scores generated groups. Wrap with ``ray.remote`` to run it as an actor.

    Args:
        config: The ``ref:`` options; None: their defaults.
        load_model: Load the reference model; False (no KL term, or LoRA, where the trainer
            computes them) leaves ``ref_logprobs`` None.
        temperature: ``inference.temperature``, so the KL term and the teacher signal compare
            distributions at the sampling temperature.
    """

    def __init__(
        self,
        *,
        model_dir: str,
        target_tokens_per_batch: int,
        share_prompts: bool = True,
        config: RefConfig | None = None,
        load_model: bool = True,
        temperature: float = 1.0,
    ) -> None:
        config = config or RefConfig()
        self.temperature = float(temperature)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.target_tokens_per_batch = target_tokens_per_batch
        self.model = self.teacher = self.mask_kind = self.pad_id = None
        if load_model or config.teacher_model_path is not None:
            # Imported here: an actor that loads no model (no KL term, no teacher: the demo's)
            # starts without torch._dynamo, torchtune and transformers, seconds of its start.
            from grpo.models import load_tokenizer
            from grpo.packing.attention import resolve_mask_kind

            self.mask_kind = resolve_mask_kind(config.mask_kind, self.device)
            self.pad_id = load_tokenizer(model_dir).pad_id
        if load_model:
            self.model = self._frozen_model(model_dir, config.dtype)
        if config.teacher_model_path is not None:
            self.teacher = self._frozen_model(config.teacher_model_path, config.teacher_dtype)
        self.distillation_coeff = config.distillation_coeff
        self.distillation_only = config.distillation_only
        self.reward_weights = config.reward_weights
        self.filter_zero_variance_groups = config.filter_zero_variance_groups
        self.advantage_std_normalization = config.advantage_std_normalization
        self.share_prompts = share_prompts
        self.steps_run = 0

    def _frozen_model(self, model_dir: str, dtype: str) -> torch.nn.Module:
        """A model folder as a frozen eval-mode model on this actor's device."""
        from grpo.models import build_model, torch_dtype
        from grpo.packing.attention import use_packed_attention

        model = build_model(
            model_dir,
            dtype=torch_dtype(dtype),
            device=self.device,
            packed_len=self.target_tokens_per_batch,
        ).eval()
        if self.mask_kind != "dense":
            use_packed_attention(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        return model

    def reference_logprobs(self, trajectories: list[Any]) -> tuple[dict[str, torch.Tensor], float]:
        """Reference logprobs of each trajectory's response, keyed by ``sequence_id``.

        Returns:
            tuple: The logprobs by ``sequence_id``, and the share (%) of tokens that shared
            prompts saved; without a reference model ``({}, 0.0)``.
        """
        if self.model is None:
            return {}, 0.0
        return self._packed_logprobs(self.model, trajectories)

    def teacher_logprobs(self, trajectories: list[Any]) -> tuple[dict[str, torch.Tensor], float]:
        """The distillation teacher's logprobs of each response, keyed by ``sequence_id``.

        Packed exactly as `reference_logprobs`, so a teacher that is the reference model gives
        the same numbers bit for bit.

        Returns:
            tuple: As `reference_logprobs`; without a teacher ``({}, 0.0)``.
        """
        if self.teacher is None:
            return {}, 0.0
        return self._packed_logprobs(self.teacher, trajectories)

    @torch.no_grad()
    def _packed_logprobs(
        self, model: torch.nn.Module, trajectories: list[Any]
    ) -> tuple[dict[str, torch.Tensor], float]:
        """A frozen model's response logprobs at the sampling temperature, by ``sequence_id``,
        and the share (%) of tokens that shared-prompt packing did not compute."""
        from grpo.packing.logprobs import model_response_logprobs
        from grpo.packing.packs import (
            FLEX_BUCKET,
            pack_sequences,
            plan_sequence_packs,
            unpack_response_logprobs,
        )

        plan = plan_sequence_packs(
            trajectories,
            self.target_tokens_per_batch,
            share_prompts=self.share_prompts,
            keep_groups_together=True,
        )
        by_id = {}
        shared_prompt_tokens = computed_tokens = 0
        for pack_indices in plan:
            members = [trajectories[i] for i in pack_indices]
            packed = pack_sequences(
                members,
                self.device,
                self.pad_id,
                mask_kind=self.mask_kind,
                pad_to_multiple_of=FLEX_BUCKET if self.mask_kind == "flex" else None,
                share_prompts=self.share_prompts,
            )
            shared_prompt_tokens += packed.shared_prompt_tokens
            computed_tokens += packed.actual_total_tokens
            logprobs = model_response_logprobs(model, packed, temperature=self.temperature)
            for traj, lp in zip(members, unpack_response_logprobs(packed, logprobs)):
                by_id[traj.sequence_id] = lp.float().cpu()
        all_tokens = computed_tokens + shared_prompt_tokens
        return by_id, (100.0 * shared_prompt_tokens / all_tokens if all_tokens else 0.0)

    def score_groups(
        self, groups: list[GroupedUnscoredTrajectories]
    ) -> tuple[list[list[ScoredTrajectory]], list[GroupedUnscoredTrajectories], dict[str, float]]:
        """Reference logprobs and advantages of whole groups, from the environment's rewards.

        Returns:
            tuple: The scored groups (in order; without the zero-variance ones when
            filtering), the zero-variance groups (in order), and timing/reward metrics.
        """
        trajectories = [t for g in groups for t in g.trajectories]
        reward_batch = env_reward_batch(trajectories)
        rewards, successes = reward_batch.rewards, reward_batch.successes
        total_reward = reward_batch.total(self.reward_weights)
        metadata = {"func_names": list(reward_batch.func_names)}

        # Rewards first: the forwards then run only on the kept groups (often under half).
        kept, zero_variance, offset = [], [], 0
        for group in groups:
            size = len(group.trajectories)
            group_reward = total_reward[offset : offset + size]
            is_zero_variance = bool(zero_variance_groups(group_reward))
            if is_zero_variance:
                zero_variance.append(group)
            if not (is_zero_variance and self.filter_zero_variance_groups):
                kept.append((group, offset, group_reward))
            offset += size

        model_start = time.perf_counter()
        kept_trajectories = [t for group, _, _ in kept for t in group.trajectories]
        ref_logprobs, shared_prompt_saved_pct = self.reference_logprobs(kept_trajectories)
        teacher_logprobs, teacher_saved_pct = self.teacher_logprobs(kept_trajectories)
        time_model_running = time.perf_counter() - model_start

        scored_groups = []
        reverse_kl_sum, policy_tokens = 0.0, 0
        for group, offset, group_reward in kept:
            advantages = group_advantages(
                group_reward, std_normalize=self.advantage_std_normalization
            )
            scored = []
            for i, traj in enumerate(group.trajectories):
                row = offset + i
                advantage = advantages[i]
                if self.teacher is not None:
                    signal = teacher_signal(
                        teacher_logprobs[traj.sequence_id], traj.logprobs, traj.response_mask
                    )
                    advantage = distillation_advantages(
                        signal,
                        self.distillation_coeff,
                        None if self.distillation_only else advantage,
                    )
                    reverse_kl_sum -= float(signal.sum())
                    policy_tokens += traj.policy_len
                scored.append(
                    ScoredTrajectory(
                        prompt_tokens=traj.prompt_tokens,
                        response_tokens=traj.response_tokens,
                        prompt_len=traj.prompt_len,
                        response_len=traj.response_len,
                        logprobs=traj.logprobs,
                        ref_logprobs=(
                            ref_logprobs[traj.sequence_id] if self.model is not None else None
                        ),
                        rewards=rewards[row],
                        advantages=advantage,
                        successes=successes[row],
                        answer=traj.answer,
                        sequence_id=traj.sequence_id,
                        group_id=traj.group_id,
                        reward_metadata=metadata,
                        policy_version=traj.policy_version,
                        response_mask=traj.response_mask,
                        episode_stats=traj.episode_stats,
                        last_policy_version=traj.last_policy_version,
                    )
                )
            scored_groups.append(scored)

        metrics = {
            names.REF_PERF_TIME_MODEL_RUNNING: time_model_running,
            names.REF_PERF_TOTAL_TOKENS_PROCESSED: float(sum(g.total_tokens for g in groups)),
            names.REWARDS_MEAN: float(total_reward.mean()),
            names.SUCCESSES_MEAN: float(successes.mean()),
        }
        if self.model is not None or self.teacher is not None:
            # Both forwards pack the same trajectories the same way.
            metrics[names.REF_PERF_SHARED_PROMPT_TOKENS_SAVED] = (
                shared_prompt_saved_pct if self.model is not None else teacher_saved_pct
            )
        if self.teacher is not None and policy_tokens:
            metrics[names.REF_TEACHER_REVERSE_KL] = reverse_kl_sum / policy_tokens
        for column, name in enumerate(reward_batch.func_names):
            metrics[names.REWARDS_FUNC_MEAN_TEMPLATE.format(name=name)] = float(
                rewards[:, column].mean()
            )
            metrics[names.SUCCESSES_FUNC_MEAN_TEMPLATE.format(name=name)] = float(
                successes[:, column].mean()
            )
        return scored_groups, zero_variance, metrics

    def score(
        self, groups: list[GroupedUnscoredTrajectories]
    ) -> tuple[dict[str, Any], list[list[ScoredTrajectory]]]:
        """Score groups the driver took from the rollout queue.

        Called with ``num_returns=2``: the driver reads the small summary and passes the scored
        groups straight on to the replay buffer.

        Returns:
            tuple: ``{"metrics", "group_ids", "sequence_ids", "num_zero_variance_groups",
            "dropped_group_ids", "dropped_sequence_ids", "policy_version", "group_rewards"}``
            and the returned scored groups, in order (possibly none).
        """
        start = time.perf_counter()
        scored_groups, zero_variance, metrics = self.score_groups(groups)
        dropped = zero_variance if self.filter_zero_variance_groups else []
        self.steps_run += 1
        total = time.perf_counter() - start
        metrics.update(
            {
                names.REF_PERF_TOTAL_ROLLOUT_TIME: total,
                names.REF_PERF_PCT_TIME_MODEL_RUNNING: 100.0
                * metrics[names.REF_PERF_TIME_MODEL_RUNNING]
                / max(total, 1e-9),
                "ref_perf/groups_scored": float(len(groups)),
            }
        )
        info = {
            "metrics": metrics,
            "group_ids": [g[0].group_id for g in scored_groups],
            "sequence_ids": [[t.sequence_id for t in g] for g in scored_groups],
            "num_zero_variance_groups": len(zero_variance),
            "dropped_group_ids": [g.group_id for g in dropped],
            "dropped_sequence_ids": [[t.sequence_id for t in g.trajectories] for g in dropped],
            "policy_version": max(t.policy_version for g in groups for t in g.trajectories),
            "group_rewards": _group_totals(groups, self.reward_weights),
        }
        return info, scored_groups

    def state_dict(self) -> dict[str, Any]:
        """Counters that continue across a resume (the actor holds no trajectories)."""
        return {"steps_run": self.steps_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.steps_run = state["steps_run"]


def _group_totals(
    groups: list[GroupedUnscoredTrajectories], reward_weights: dict[str, float] | None
) -> list[list[float]]:
    """Each group's total rewards (weighted as the advantages weigh them), one per episode."""
    totals = env_reward_batch([t for g in groups for t in g.trajectories]).total(reward_weights)
    result, offset = [], 0
    for group in groups:
        size = len(group.trajectories)
        result.append(totals[offset : offset + size].tolist())
        offset += size
    return result
