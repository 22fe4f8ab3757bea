"""Sequence packing: many unpadded sequences in one block-causal row.

``[P1 R1 P2 R2 ... Pn Rn PAD...]``: prompts and responses are concatenated without padding
between them; padding, when asked for, is one extra block at the tail. Position ids restart at 0
for every sequence and the attention mask is block-causal, so each sequence sees exactly what it
would see alone: its logprobs do not depend on what it is packed with.

The logprob of the token at position ``t`` comes from the logits at ``t - 1``. That shift lives
in `logprobs_from_logits` here (and in the chunked loss, which reads ``targets``); ``targets``
are the response tokens in pack order, so ``hidden[:-1][response_mask[1:]]`` lines up with them.

Every per-token tensor is built with vectorised ops (``repeat_interleave``, ``cumsum``,
comparisons of block ids); Python loops run over sequences, never over tokens.

Pure torch: no Ray, no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from grpo.attention import VarlenMask
from grpo.types import PackedTrajectory, ScoredTrajectory, UnscoredTrajectory

__all__ = [
    "FLEX_BUCKET",
    "MASK_KINDS",
    "logprobs_from_logits",
    "pack_by_budget",
    "pack_sequences",
    "packed_forward_inputs",
    "padding_fraction",
    "plan_packs",
    "unpack_response_logprobs",
]

MASK_KINDS = ("dense", "flex", "varlen")

# What the actors pad flex packs to a multiple of (``pad_to_multiple_of``). FlexAttention is
# compiled once per pack length (on CPU a static compile each, and after 8 lengths dynamo falls
# back to the slow uncompiled path; see `grpo.attention`), so flex packs must take few distinct
# lengths. 128 is FlexAttention's block size: the padding never adds a mask block.
FLEX_BUCKET = 128


def _check_sequences(sequences: Sequence[Any]) -> bool:
    """Validate what `pack_sequences` is given; return True for ScoredTrajectory input."""
    if len(sequences) == 0:
        raise ValueError("pack_sequences: cannot pack an empty list of sequences")
    first = sequences[0]
    if not isinstance(first, UnscoredTrajectory | ScoredTrajectory):
        raise ValueError(
            "pack_sequences: expected UnscoredTrajectory or ScoredTrajectory, got "
            f"{type(first).__name__} at index 0"
        )
    kind = type(first)
    devices: dict[torch.device, str] = {}
    for index, seq in enumerate(sequences):
        if type(seq) is not kind:
            raise ValueError(
                f"pack_sequences: cannot mix trajectory types: index 0 is {kind.__name__}, "
                f"index {index} (sequence_id={getattr(seq, 'sequence_id', None)!r}) is "
                f"{type(seq).__name__}"
            )
        owner = f"pack_sequences: sequence_id={seq.sequence_id!r} (index {index})"
        # The dataclasses check this when built; fields can be reassigned afterwards.
        if seq.prompt_len < 1:
            raise ValueError(f"{owner}: prompt_len must be >= 1, got {seq.prompt_len}")
        tensors = {
            "prompt_tokens": (seq.prompt_tokens, seq.prompt_len),
            "response_tokens": (seq.response_tokens, seq.response_len),
            "logprobs": (seq.logprobs, seq.response_len),
        }
        if kind is ScoredTrajectory:
            tensors["ref_logprobs"] = (seq.ref_logprobs, seq.response_len)
        for name, (tensor, length) in tensors.items():
            if tensor.dim() != 1 or tensor.numel() != length:
                raise ValueError(
                    f"{owner}: {name} has shape {tuple(tensor.shape)}, expected ({length},)"
                )
            devices.setdefault(tensor.device, f"{name} of sequence_id={seq.sequence_id!r}")
        if len(devices) > 1:
            described = ", ".join(f"{dev} ({where})" for dev, where in devices.items())
            raise ValueError(f"pack_sequences: tensors are on mixed devices: {described}")
    return kind is ScoredTrajectory


def _padded_length(
    total_tokens: int, target_tokens_per_batch: int | None, pad_to_multiple_of: int | None
) -> int:
    """Length of the pack after tail padding (see `pack_sequences` for the rules)."""
    if pad_to_multiple_of is not None:
        if pad_to_multiple_of < 1:
            raise ValueError(
                f"pack_sequences: pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}"
            )
        length = math.ceil(total_tokens / pad_to_multiple_of) * pad_to_multiple_of
        if target_tokens_per_batch is not None:
            length = min(length, target_tokens_per_batch)
        return length
    if target_tokens_per_batch is not None:
        return target_tokens_per_batch
    return total_tokens


def _block_causal_block_mask(block_ids: torch.Tensor, device: torch.device) -> BlockMask:
    """FlexAttention BlockMask: same block and causal. O(L) memory."""
    length = block_ids.numel()

    def mask_mod(batch, head, q_idx, kv_idx):
        return (block_ids[q_idx] == block_ids[kv_idx]) & (q_idx >= kv_idx)

    # B=None, H=None: one mask broadcast over batch and heads.
    return create_block_mask(mask_mod, None, None, length, length, device=device)


def pack_sequences(
    sequences: Sequence[UnscoredTrajectory] | Sequence[ScoredTrajectory],
    device: torch.device | str,
    pad_token_id: int,
    ignore_index: int = -100,
    target_tokens_per_batch: int | None = None,
    mask_kind: str = "dense",
    pad_to_multiple_of: int | None = None,
) -> PackedTrajectory:
    """Concatenate sequences into one block-causal row ``[P1 R1 ... Pn Rn PAD...]``.

    Padding, if any, is one extra block at the tail (``sequence_mask == -1``, its own position
    ids from 0, attending only within itself so no attention row is empty). Sequences are never
    padded inside. Tail padding rules:

    - ``target_tokens_per_batch`` alone: pad to exactly that many tokens (a static shape).
    - ``pad_to_multiple_of`` alone: pad up to the next multiple (few distinct shapes, little
      padding).
    - both: the next multiple, capped at ``target_tokens_per_batch``.
    - neither: no padding.

    ``target_tokens_per_batch`` is also the budget: a pack longer than it is an error (split the
    batch with `plan_packs` first).

    Args:
        sequences: Sequences to pack, all `UnscoredTrajectory` or all `ScoredTrajectory`.
        device (torch.device | str): Device of the packed tensors (and of the mask).
        pad_token_id (int): Token id used for tail padding.
        ignore_index (int): Accepted for callers that pass a loss ignore index; ``targets``
            hold response tokens only, so no position is filled with it.
        target_tokens_per_batch (int | None): Token budget of the pack; see above.
        mask_kind (str): ``"dense"`` (bool ``[L, L]``, True = may attend), ``"flex"``
            (FlexAttention ``BlockMask``) or ``"varlen"`` (`grpo.attention.VarlenMask`).
            ``"flex"`` and ``"varlen"`` need `grpo.attention.use_packed_attention` on the model
            on CPU (``"varlen"`` on every device). On CPU FlexAttention has no backward and
            compiles once per pack length: give flex packs a ``pad_to_multiple_of``.
        pad_to_multiple_of (int | None): Bucket size for tail padding; see above.

    Returns:
        PackedTrajectory: ``targets`` and ``behavior_logprobs`` (the sequences' ``logprobs``)
        are always filled; ``ref_logprobs`` and per-token ``advantages`` (the sequence's scalar
        advantage repeated over its response) only for `ScoredTrajectory` input.

    Raises:
        ValueError: Empty input; mixed trajectory types; tensors on mixed devices; a tensor
            whose length disagrees with its ``*_len``; ``prompt_len`` 0; a sequence, or the
            whole pack, longer than ``target_tokens_per_batch``; an unknown ``mask_kind``.

    Example:
        >>> packed = pack_sequences(trajectories, "cpu", pad_token_id=0, pad_to_multiple_of=64)
        >>> logits = model(**packed_forward_inputs(packed))
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(
            f"pack_sequences: mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}"
        )
    is_scored = _check_sequences(sequences)
    device = torch.device(device)

    prompt_lens_list = [seq.prompt_len for seq in sequences]
    response_lens_list = [seq.response_len for seq in sequences]
    total_tokens = sum(prompt_lens_list) + sum(response_lens_list)
    if target_tokens_per_batch is not None:
        if target_tokens_per_batch < 1:
            raise ValueError(
                "pack_sequences: target_tokens_per_batch must be >= 1, "
                f"got {target_tokens_per_batch}"
            )
        for seq in sequences:
            if seq.total_len > target_tokens_per_batch:
                raise ValueError(
                    f"pack_sequences: sequence_id={seq.sequence_id!r} has {seq.total_len} tokens "
                    f"(prompt_len={seq.prompt_len}, response_len={seq.response_len}), more than "
                    f"target_tokens_per_batch={target_tokens_per_batch}"
                )
        if total_tokens > target_tokens_per_batch:
            raise ValueError(
                f"pack_sequences: {len(sequences)} sequences hold {total_tokens} tokens, more "
                f"than target_tokens_per_batch={target_tokens_per_batch}; split them with "
                "plan_packs"
            )
    packed_seq_len = _padded_length(total_tokens, target_tokens_per_batch, pad_to_multiple_of)
    num_padding = packed_seq_len - total_tokens

    # Tokens: one cat where the sequences live, then a single move to the device.
    source_device = sequences[0].prompt_tokens.device
    pieces = [t for seq in sequences for t in (seq.prompt_tokens, seq.response_tokens)]
    if num_padding:
        pieces.append(torch.full((num_padding,), pad_token_id, device=source_device))
    tokens = torch.cat([piece.long() for piece in pieces]).to(device)

    num_sequences = len(sequences)
    prompt_lens = torch.tensor(prompt_lens_list, dtype=torch.long, device=device)
    response_lens = torch.tensor(response_lens_list, dtype=torch.long, device=device)
    # Blocks are the sequences plus, if padded, one padding block at the tail.
    block_lens_list = [p + r for p, r in zip(prompt_lens_list, response_lens_list)]
    if num_padding:
        block_lens_list.append(num_padding)
    block_lens = torch.tensor(block_lens_list, dtype=torch.long, device=device)
    block_ends = torch.cumsum(block_lens, dim=0)
    block_starts = block_ends - block_lens
    block_ids = torch.repeat_interleave(
        torch.arange(len(block_lens_list), device=device), block_lens
    )

    positions = torch.arange(packed_seq_len, device=device)
    position_ids = positions - block_starts[block_ids]
    sequence_mask = torch.where(block_ids < num_sequences, block_ids, -1)
    # The padding block's "prompt" is all of it, so none of it counts as response.
    block_prompt_lens = torch.cat([prompt_lens, block_lens[num_sequences:]])
    response_mask = position_ids >= block_prompt_lens[block_ids]
    sequence_map = torch.stack([block_starts[:num_sequences], block_ends[:num_sequences]], dim=1)
    targets = tokens[response_mask]

    def flat(name: str) -> torch.Tensor:
        values = torch.cat([getattr(seq, name).float() for seq in sequences])
        return values.to(device)

    behavior_logprobs = flat("logprobs")
    ref_logprobs = advantages = None
    if is_scored:
        ref_logprobs = flat("ref_logprobs")
        sequence_advantages = torch.stack(
            [seq.advantages.reshape(()).to(device=device, dtype=torch.float32) for seq in sequences]
        )
        advantages = torch.repeat_interleave(sequence_advantages, response_lens)

    if mask_kind == "dense":
        same_block = block_ids[:, None] == block_ids[None, :]
        attention_mask = same_block & (positions[:, None] >= positions[None, :])
    elif mask_kind == "flex":
        attention_mask = _block_causal_block_mask(block_ids, device)
    else:
        attention_mask = VarlenMask(tuple(block_lens_list))

    return PackedTrajectory(
        tokens=tokens,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        sequence_mask=sequence_mask,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        sequence_map=sequence_map,
        packed_seq_len=packed_seq_len,
        targets=targets,
        ref_logprobs=ref_logprobs,
        advantages=advantages,
        behavior_logprobs=behavior_logprobs,
        sequence_ids=[seq.sequence_id for seq in sequences],
        group_ids=[seq.group_id for seq in sequences],
        actual_total_tokens=total_tokens,
    )


def unpack_response_logprobs(
    packed: PackedTrajectory, packed_logprobs: torch.Tensor
) -> list[torch.Tensor]:
    """Split per-response-token values of a pack back into one tensor per sequence.

    Args:
        packed (PackedTrajectory): The pack the values were computed on.
        packed_logprobs (torch.Tensor): Shape ``(packed.num_response_tokens,)``, aligned with
            ``packed.targets`` (e.g. from `logprobs_from_logits`).

    Returns:
        list[torch.Tensor]: ``packed.num_sequences`` views; entry i has ``response_lens[i]``
        elements (possibly 0).

    Raises:
        ValueError: If ``packed_logprobs`` is not 1-D of the pack's response-token count.
    """
    expected = packed.num_response_tokens
    if packed_logprobs.dim() != 1 or packed_logprobs.numel() != expected:
        raise ValueError(
            f"unpack_response_logprobs: expected shape ({expected},) (the pack's response "
            f"tokens), got {tuple(packed_logprobs.shape)}"
        )
    return list(torch.split(packed_logprobs, packed.response_lens.tolist()))


def logprobs_from_logits(logits: torch.Tensor, packed: PackedTrajectory) -> torch.Tensor:
    """Logprobs of the response tokens of a pack, from the model's full logits.

    The token at ``t`` is scored by the logits at ``t - 1``. Only response rows are kept
    before the fp32 log-softmax. (Training uses the chunked loss on hidden states instead,
    which never materialises ``[L, V]`` logits.)

    Args:
        logits (torch.Tensor): ``[L, V]`` or ``[1, L, V]``.
        packed (PackedTrajectory): The pack the logits were computed on.

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
    response_logits = logits[:-1][packed.response_mask[1:]].float()
    log_probs = F.log_softmax(response_logits, dim=-1)
    return log_probs.gather(1, packed.targets[:, None]).squeeze(1)


def packed_forward_inputs(packed: PackedTrajectory) -> dict[str, Any]:
    """Keyword arguments for a torchtune ``TransformerDecoder`` forward over a pack.

    torchtune 0.6.1 takes ``model(tokens, mask=..., input_pos=...)``: ``mask`` is a bool
    ``[b, s, s]`` tensor or a ``BlockMask``; ``input_pos`` ``[b, s]`` selects the RoPE rows, so
    restarting position ids make each sequence see positions 0, 1, ... as if alone.

    Args:
        packed (PackedTrajectory): The pack.

    Returns:
        dict: ``tokens`` ``[1, L]``, ``mask`` (``[1, L, L]`` for a dense mask; a ``BlockMask``
        or `VarlenMask` as is, they already describe the single row) and ``input_pos``
        ``[1, L]``.

    Example:
        >>> logits = model(**packed_forward_inputs(packed))  # [1, L, V]
    """
    mask = packed.attention_mask
    if isinstance(mask, torch.Tensor):
        mask = mask[None]
    return {"tokens": packed.tokens[None], "mask": mask, "input_pos": packed.position_ids[None]}


def plan_packs(
    lengths: Sequence[int],
    target_tokens_per_batch: int,
    groups: Sequence[Any] | None = None,
) -> list[list[int]]:
    """Assign items to packs of at most ``target_tokens_per_batch`` tokens (first-fit decreasing).

    Items are placed longest first (ties: lower index first) into the first pack with room,
    which keeps the number of packs close to ``ceil(sum(lengths) / budget)`` for typical RL
    batches (many items, each well under the budget). Deterministic.

    With ``groups``, the items of one group are placed as a single unit (its total length), so
    a group is never split across packs, unless the group alone exceeds the budget: its items
    are then placed one by one, and only that group is split.

    Args:
        lengths (Sequence[int]): Token count of each item (prompt plus response).
        target_tokens_per_batch (int): Token budget of a pack.
        groups (Sequence | None): One hashable group id per item.

    Returns:
        list[list[int]]: Item indices of each pack, every index exactly once; within a pack
        the items of a group are contiguous and in input order.

    Raises:
        ValueError: Budget < 1, a negative length, ``groups`` of another length, or an item
            longer than the budget (named by index and length).

    Example:
        >>> plan_packs([300, 200, 250, 100], 500)
        [[0, 1], [2, 3]]
    """
    if target_tokens_per_batch < 1:
        raise ValueError(
            f"plan_packs: target_tokens_per_batch must be >= 1, got {target_tokens_per_batch}"
        )
    lengths = [int(length) for length in lengths]
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"plan_packs: lengths[{index}] is negative ({length})")
        if length > target_tokens_per_batch:
            raise ValueError(
                f"plan_packs: item {index} has {length} tokens, more than "
                f"target_tokens_per_batch={target_tokens_per_batch}"
            )
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"plan_packs: {len(groups)} group ids for {len(lengths)} lengths")

    # Units are placed atomically: a whole group when it fits, otherwise single items.
    if groups is None:
        units = [[index] for index in range(len(lengths))]
    else:
        members: dict[Any, list[int]] = {}
        for index, group in enumerate(groups):
            members.setdefault(group, []).append(index)
        units = []
        for indices in members.values():
            if sum(lengths[i] for i in indices) <= target_tokens_per_batch:
                units.append(indices)
            else:
                units.extend([i] for i in indices)
    unit_lens = [sum(lengths[i] for i in unit) for unit in units]

    # First-fit decreasing; O(units * packs), a few thousand steps for a training batch.
    order = sorted(range(len(units)), key=lambda u: (-unit_lens[u], units[u][0]))
    packs: list[list[int]] = []
    room: list[int] = []
    for unit in order:
        size = unit_lens[unit]
        for pack_index, free in enumerate(room):
            if size <= free:
                packs[pack_index].extend(units[unit])
                room[pack_index] -= size
                break
        else:
            packs.append(list(units[unit]))
            room.append(target_tokens_per_batch - size)
    return packs


def pack_by_budget(
    sequences: Sequence[UnscoredTrajectory] | Sequence[ScoredTrajectory],
    device: torch.device | str,
    pad_token_id: int,
    target_tokens_per_batch: int,
    keep_groups_together: bool = False,
    pad_to_budget: bool = False,
    mask_kind: str = "dense",
    pad_to_multiple_of: int | None = None,
) -> list[PackedTrajectory]:
    """Plan packs with `plan_packs` and build them with `pack_sequences`.

    Args:
        sequences: The batch, all `UnscoredTrajectory` or all `ScoredTrajectory`.
        device (torch.device | str): Device of the packs.
        pad_token_id (int): Padding token id.
        target_tokens_per_batch (int): Token budget of each pack.
        keep_groups_together (bool): Never split a ``group_id`` across packs (unless the group
            alone exceeds the budget).
        pad_to_budget (bool): Pad every pack to exactly the budget (one static shape).
            Otherwise packs are padded only up to ``pad_to_multiple_of``, if given.
        mask_kind (str): See `pack_sequences`.
        pad_to_multiple_of (int | None): See `pack_sequences`.

    Returns:
        list[PackedTrajectory]: The packs, in plan order.

    Raises:
        ValueError: As `plan_packs` and `pack_sequences`.
    """
    plan = plan_packs(
        [seq.total_len for seq in sequences],
        target_tokens_per_batch,
        groups=[seq.group_id for seq in sequences] if keep_groups_together else None,
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
            [sequences[i] for i in indices], device, pad_token_id, mask_kind=mask_kind, **padding
        )
        for indices in plan
    ]


def padding_fraction(packs: Sequence[PackedTrajectory]) -> float:
    """Share of padding tokens over all tokens of some packs (0.0 for no tokens).

    Args:
        packs (Sequence[PackedTrajectory]): Packs, e.g. the micro-batches of one step.

    Returns:
        float: ``sum(padding) / sum(packed_seq_len)``.
    """
    total = sum(pack.packed_seq_len for pack in packs)
    padding = sum(pack.padding_tokens for pack in packs)
    return padding / total if total else 0.0
