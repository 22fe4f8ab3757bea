"""The plain reference computation of response logprobs from full logits."""

from __future__ import annotations

import torch


def response_logprobs_from_logits(
    logits: torch.Tensor, response_mask: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Logprobs of the response tokens from full logits: the plain reference computation.

    Args:
        logits (torch.Tensor): ``[L, V]`` or ``[1, L, V]`` logits of one packed row.
        response_mask (torch.Tensor): Bool ``[L]``, True on response tokens.
        targets (torch.Tensor): Response token ids in pack order, ``[T]``.

    Returns:
        torch.Tensor: Logprobs ``[T]``, in float32 or wider (float64 logits stay float64).
    """
    if logits.dim() == 3:
        logits = logits[0]
    # The logits at t - 1 predict the token at t.
    response_logits = logits[:-1][response_mask[1:].to(logits.device).bool()]
    logprobs = response_logits.to(torch.promote_types(logits.dtype, torch.float32))
    logprobs = logprobs.log_softmax(dim=-1)
    return logprobs.gather(1, targets.to(logits.device).long()[:, None]).squeeze(1)
