"""Reference and benchmark helpers around `grpo.packing.packs`: logprobs from full logits, and
packing a whole batch by token budget with its padding share."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from grpo.packing.packs import pack_sequences, plan_sequence_packs
from grpo.types import PackedTrajectory, ScoredTrajectory, UnscoredTrajectory


def logprobs_from_logits(logits: torch.Tensor, packed: PackedTrajectory) -> torch.Tensor:
    """Logprobs of the response tokens of a pack, from the model's full logits.

    Args:
        logits (torch.Tensor): ``[L, V]`` or ``[1, L, V]``.

    Returns:
        torch.Tensor: fp32 ``(packed.num_response_tokens,)`` aligned with ``packed.targets``.

    Raises:
        ValueError: If ``logits`` does not have the pack's length.
    """
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[0] != packed.packed_seq_len:
        raise ValueError(
            f"logprobs_from_logits: expected logits of shape ({packed.packed_seq_len}, V), "
            f"got {tuple(logits.shape)}"
        )
    response_logits = logits.index_select(0, packed.logit_positions).float()
    log_probs = F.log_softmax(response_logits, dim=-1)
    return log_probs.gather(1, packed.targets[:, None]).squeeze(1)


def pack_by_budget(
    sequences: Sequence[UnscoredTrajectory] | Sequence[ScoredTrajectory],
    device: torch.device | str,
    pad_token_id: int,
    target_tokens_per_batch: int,
    keep_groups_together: bool = False,
    pad_to_budget: bool = False,
    mask_kind: str = "dense",
    pad_to_multiple_of: int | None = None,
    share_prompts: bool = False,
) -> list[PackedTrajectory]:
    """Plan packs with `plan_sequence_packs` and build them with `pack_sequences`.

    Args:
        pad_to_budget (bool): Pad every pack to exactly the budget (one static shape).
            Otherwise packs are padded only up to ``pad_to_multiple_of``, if given.

    Raises:
        ValueError: As `plan_sequence_packs` and `pack_sequences`.
    """
    plan = plan_sequence_packs(
        sequences,
        target_tokens_per_batch,
        share_prompts=share_prompts,
        keep_groups_together=keep_groups_together,
    )
    if pad_to_budget:
        padding = {"target_tokens_per_batch": target_tokens_per_batch}
    elif pad_to_multiple_of is not None:
        # The budget caps the bucketed length.
        padding = {
            "target_tokens_per_batch": target_tokens_per_batch,
            "pad_to_multiple_of": pad_to_multiple_of,
        }
    else:
        padding = {}
    return [
        pack_sequences(
            [sequences[i] for i in indices],
            device,
            pad_token_id,
            mask_kind=mask_kind,
            share_prompts=share_prompts,
            **padding,
        )
        for indices in plan
    ]


def padding_fraction(packs: Sequence[PackedTrajectory]) -> float:
    """Share of padding tokens over all tokens of some packs (0.0 for no tokens)."""
    total = sum(pack.packed_seq_len for pack in packs)
    padding = sum(pack.padding_tokens for pack in packs)
    return padding / total if total else 0.0
