"""GRPO advantages: each sample's total reward relative to the other samples of its group.

Also which groups carry no learning signal at all (`zero_variance_groups`): those whose
rewards are all equal, which dynamic sampling (``ref.filter_zero_variance_groups``)
leaves out of the replay buffer.
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
