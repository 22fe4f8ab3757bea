"""Advantages: GRPO's per sample, and on-policy distillation's per token.

GRPO (`group_advantages`): each sample's total reward relative to the other samples of its
group, one number for all of its tokens. Also which groups carry no learning signal at all
(`zero_variance_groups`): those whose rewards are all equal, which dynamic sampling
(``ref.filter_zero_variance_groups``) leaves out of the replay buffer.

On-policy distillation (`teacher_signal`, `distillation_advantages`; ``ref.teacher_model_path``):
a teacher scores the tokens the policy sampled, and each token's advantage gets
``coeff * (log pi_teacher(x_t) - log mu(x_t))``, with ``mu`` the behaviour policy that sampled
it (the engine's logprobs). Its expectation over the sampled tokens is minus the reverse KL
``KL(mu || pi_teacher)`` per token, so the policy gradient of this reward lowers the reverse KL
to the teacher on the student's own samples: Agarwal et al., "On-Policy Distillation of
Language Models" (GKD, 2024); Thinking Machines, "On-Policy Distillation" (2025); Qwen3's
on-policy distillation stage (arXiv:2505.09388). As there the per-token reward is a constant of
the loss (detached, no discounting over later tokens), so the trainer's loss and its ratio,
clipping and corrections apply to it unchanged.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-4, std_normalize: bool = True
) -> torch.Tensor:
    """GRPO advantages of one group (or of each row of a batch of groups).

    ``(r - mean) / (std + eps)`` with the unbiased (Bessel-corrected, ``torch.std`` default)
    standard deviation of the group, as in DeepSeekMath's GRPO and TRL. ``eps`` (default
    ``1e-4``) only keeps the division finite when the rewards nearly agree; it is added to the
    std, not the variance. A group whose rewards are all equal, or that has one member,
    carries no learning signal and gets exactly zeros. ``std_normalize=False`` gives
    ``r - mean`` (Dr. GRPO).

    Args:
        rewards (torch.Tensor): Total rewards, shape ``(G,)`` or ``(num_groups, G)``.
        eps (float): Added to the std.
        std_normalize (bool): Divide by the std.

    Returns:
        torch.Tensor: float32 advantages, same shape as ``rewards``.

    Raises:
        ValueError: If ``rewards`` is not 1-D or 2-D, or a group is empty.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
        tensor([ 0.8659, -0.8659, -0.8659,  0.8659])
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
    # Exact zeros for constant groups: the mean of equal floats can differ from them in the
    # last bit, and with eps=0 their 0/0 would be NaN.
    return advantages.masked_fill(zero_variance_groups(rewards).unsqueeze(-1), 0.0)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Whether each group's total rewards are all exactly equal (no learning signal).

    Such a group gets all-zero advantages (`group_advantages`), so its policy-gradient term
    is zero whatever the policy does. A group of one sample counts as zero-variance: it has
    nothing to be compared with.

    Args:
        rewards (torch.Tensor): Total rewards, shape ``(G,)`` or ``(num_groups, G)``.

    Returns:
        torch.Tensor: bool, shape ``()`` for one group or ``(num_groups,)``.

    Raises:
        ValueError: If ``rewards`` is not 1-D or 2-D, or a group is empty.

    Example:
        >>> zero_variance_groups(torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
        tensor([ True, False])
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

    Both logprobs are those of the tokens the policy sampled, at the sampling temperature
    (the engine's processed logprobs, and the teacher's logits divided by the same
    temperature, as the reference's are). Its mean over a response's policy tokens is minus
    the sampled estimate of the reverse KL ``KL(mu || pi_teacher)`` per token.

    Args:
        teacher_logprobs (torch.Tensor): The teacher's logprobs, shape ``(T,)``.
        behaviour_logprobs (torch.Tensor): The sampler's logprobs, shape ``(T,)``.
        response_mask (torch.Tensor | None): Bool ``(T,)``, False on the environment's tokens
            of a multi-turn episode (not sampled by the policy, their behaviour logprob a 0
            placeholder): they get exactly 0. None: every token is the policy's.

    Returns:
        torch.Tensor: float32 ``(T,)``, detached.

    Raises:
        ValueError: If the shapes differ or are not 1-D.

    Example:
        >>> teacher_signal(torch.tensor([-0.5, -2.0]), torch.tensor([-1.0, -1.0]))
        tensor([ 0.5000, -1.0000])
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
        signal (torch.Tensor): `teacher_signal` of one response, shape ``(T,)``.
        coeff (float): Weight of the signal (``ref.distillation_coeff``).
        grpo_advantage (torch.Tensor | None): The response's GRPO advantage (a scalar, from
            `group_advantages`), added to every token; None: the signal alone
            (``ref.distillation_only``).

    Returns:
        torch.Tensor: float32 ``(T,)``, detached.

    Example:
        >>> distillation_advantages(torch.tensor([0.5, -1.0]), 0.5, torch.tensor(1.0))
        tensor([1.2500, 0.5000])
    """
    advantages = coeff * signal.detach().float()
    if grpo_advantage is not None:
        advantages = advantages + grpo_advantage.detach().float().reshape(())
    return advantages
