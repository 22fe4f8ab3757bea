"""Advantages: GRPO's per sample, and on-policy distillation's per token.

GRPO: each sample's total reward relative to its group, one number for all of its tokens.
Distillation: each token adds ``coeff * (log pi_teacher - log mu)``, a detached per-token reward
whose expectation is minus the reverse KL to the teacher on the policy's own samples
(docs/training.md, "On-policy distillation", gives the sources).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-4, std_normalize: bool = True
) -> torch.Tensor:
    """GRPO advantages ``(r - mean) / (std + eps)`` of one group or of each row.

    The std is unbiased (as in DeepSeekMath and TRL). A constant group, or one of a single
    sample, gets exactly zeros.

    Args:
        rewards: Total rewards, shape ``(G,)`` or ``(num_groups, G)``.
        eps: Added to the std, only to keep the division finite.
        std_normalize: Divide by the std; False gives ``r - mean`` (Dr. GRPO).

    Returns:
        torch.Tensor: float32 advantages, same shape as ``rewards``.

    Raises:
        ValueError: If ``rewards`` is not 1-D or 2-D, or a group is empty.
    """
    if rewards.dim() not in (1, 2) or rewards.shape[-1] == 0:
        raise ValueError(
            f"group_advantages: rewards must have shape (G,) or (num_groups, G) with G >= 1, "
            f"got {tuple(rewards.shape)}"
        )
    rewards = rewards.to(torch.float32)
    if rewards.shape[-1] == 1:
        return torch.zeros_like(rewards)
    advantages = rewards - rewards.mean(dim=-1, keepdim=True)
    if std_normalize:
        advantages = advantages / (rewards.std(dim=-1, keepdim=True) + eps)
    # Exact zeros: the mean of equal floats can differ in the last bit; with eps=0, 0/0 is NaN.
    return advantages.masked_fill(zero_variance_groups(rewards).unsqueeze(-1), 0.0)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Whether each group's total rewards are all exactly equal (a group of one sample is).

    Args:
        rewards: Total rewards, shape ``(G,)`` or ``(num_groups, G)``.

    Returns:
        torch.Tensor: bool, shape ``()`` for one group or ``(num_groups,)``.

    Raises:
        ValueError: If ``rewards`` is not 1-D or 2-D, or a group is empty.
    """
    if rewards.dim() not in (1, 2) or rewards.shape[-1] == 0:
        raise ValueError(
            f"zero_variance_groups: rewards must have shape (G,) or (num_groups, G) with "
            f"G >= 1, got {tuple(rewards.shape)}"
        )
    # Exact equality, not a tolerance: any difference gives non-zero advantages.
    return (rewards == rewards[..., :1]).all(dim=-1)


def teacher_signal(
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token distillation signal ``log pi_teacher - log mu`` of one response.

    Both logprobs are of the sampled tokens at the sampling temperature.

    Args:
        teacher_logprobs, behaviour_logprobs: The teacher's and the sampler's, shape ``(T,)``.
        response_mask: Bool ``(T,)``, False on environment tokens, which get exactly 0.
            None: every token is the policy's.

    Returns:
        torch.Tensor: float32 ``(T,)``, detached.

    Raises:
        ValueError: If the shapes differ or are not 1-D.
    """
    shape = tuple(behaviour_logprobs.shape)
    if behaviour_logprobs.dim() != 1 or tuple(teacher_logprobs.shape) != shape:
        raise ValueError(
            f"teacher_signal: teacher and behaviour logprobs must have the same shape (T,), "
            f"got {tuple(teacher_logprobs.shape)} and {shape}"
        )
    if response_mask is not None and tuple(response_mask.shape) != shape:
        raise ValueError(
            f"teacher_signal: response_mask must have shape {shape}, got "
            f"{tuple(response_mask.shape)}"
        )
    signal = teacher_logprobs.detach().float() - behaviour_logprobs.detach().float()
    if response_mask is not None:
        # where(), not a product: an environment token's teacher logprob may be -inf.
        signal = torch.where(response_mask.bool(), signal, torch.zeros_like(signal))
    return signal


def distillation_advantages(
    signal: torch.Tensor, coeff: float, grpo_advantage: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation: ``A_grpo + coeff * signal``.

    Args:
        signal: `teacher_signal` of one response, shape ``(T,)``.
        grpo_advantage: The response's scalar GRPO advantage, added to every token; None:
            the signal alone.

    Returns:
        torch.Tensor: float32 ``(T,)``, detached.
    """
    advantages = coeff * signal.detach().float()
    if grpo_advantage is not None:
        advantages = advantages + grpo_advantage.detach().float().reshape(())
    return advantages
