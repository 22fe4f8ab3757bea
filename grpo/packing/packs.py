"""Sequence packing: many unpadded sequences in one block-causal row.

``[P1 R1 P2 R2 ... Pn Rn PAD...]``: position ids restart at 0 for every sequence and the mask
is block-causal, so each sequence's logprobs do not depend on what it is packed with.

With ``share_prompts`` the responses of one group that share identical prompt tokens are laid
out as ``[P R1 ... RG]``: each response attends to all of ``P`` and causally to itself, with
the positions it would have alone, so logprobs and gradients match the unshared layout up to
fp32 rounding. ``targets`` are the response tokens in sequence order;
``hidden[logit_positions]`` lines up with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from grpo.packing.attention import FLEX_BLOCK_SIZE, VarlenMask
from grpo.types import PackedTrajectory, ScoredTrajectory, UnscoredTrajectory

__all__ = [
    "FLEX_BUCKET",
    "MASK_KINDS",
    "pack_sequences",
    "packed_forward_inputs",
    "plan_packs",
    "plan_sequence_packs",
    "prompt_groups",
    "shard_batch",
    "shared_prompt_units",
    "unpack_response_logprobs",
]

MASK_KINDS = ("dense", "flex", "varlen")

# FlexAttention compiles once per pack length on CPU (after 8, dynamo falls back to the slow
# path), so flex packs are padded to a multiple of its block size, which never adds a mask block
# (and on CUDA spares the kernel its bounds checks: `flex_kernel_options`).
FLEX_BUCKET = FLEX_BLOCK_SIZE


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
        if kind is ScoredTrajectory and seq.ref_logprobs is not None:
            tensors["ref_logprobs"] = (seq.ref_logprobs, seq.response_len)
        if seq.response_mask is not None:
            tensors["response_mask"] = (seq.response_mask, seq.response_len)
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


def _block_causal_block_mask(
    block_ids: torch.Tensor, prefix_ids: torch.Tensor | None, device: torch.device
) -> BlockMask:
    """FlexAttention BlockMask: same block and causal (or the block's prefix). O(L) memory."""
    length = block_ids.numel()
    if prefix_ids is None:

        def mask_mod(batch, head, q_idx, kv_idx):
            return (block_ids[q_idx] == block_ids[kv_idx]) & (q_idx >= kv_idx)

    else:
        # A response block also sees its whole prompt block; -1 (no prefix) matches no block.
        def mask_mod(batch, head, q_idx, kv_idx):
            same_block = (block_ids[q_idx] == block_ids[kv_idx]) & (q_idx >= kv_idx)
            return same_block | (prefix_ids[q_idx] == block_ids[kv_idx])

    # B=None, H=None: one mask broadcast over batch and heads.
    return create_block_mask(mask_mod, None, None, length, length, device=device)


def prompt_groups(sequences: Sequence[Any]) -> list[list[int]]:
    """Indices of the sequences that can share one prompt: same ``group_id`` and prompt tokens.

    Returns:
        list[list[int]]: One list per distinct (group_id, prompt), in order of first
        appearance, each in input order; every index exactly once.
    """
    groups: list[list[int]] = []
    candidates: dict[tuple[Any, int], list[int]] = {}
    for index, seq in enumerate(sequences):
        seen = candidates.setdefault((seq.group_id, seq.prompt_len), [])
        for group_index in seen:
            first = sequences[groups[group_index][0]]
            if torch.equal(first.prompt_tokens.long(), seq.prompt_tokens.long()):
                groups[group_index].append(index)
                break
        else:
            seen.append(len(groups))
            groups.append([index])
    return groups


def _unit_tokens(sequences: Sequence[Any], unit: Sequence[int]) -> int:
    """Tokens of sequences laid out with their (shared) prompt once."""
    return sequences[unit[0]].prompt_len + sum(sequences[i].response_len for i in unit)


def _check_fits(sequences: Sequence[Any], target_tokens_per_batch: int, caller: str) -> None:
    if target_tokens_per_batch < 1:
        raise ValueError(
            f"{caller}: target_tokens_per_batch must be >= 1, got {target_tokens_per_batch}"
        )
    for seq in sequences:
        if seq.total_len > target_tokens_per_batch:
            raise ValueError(
                f"{caller}: sequence_id={seq.sequence_id!r} has {seq.total_len} tokens "
                f"(prompt_len={seq.prompt_len}, response_len={seq.response_len}), more than "
                f"target_tokens_per_batch={target_tokens_per_batch}"
            )


def shared_prompt_units(sequences: Sequence[Any], target_tokens_per_batch: int) -> list[list[int]]:
    """`prompt_groups`, each split (with its own copy of the prompt) to fit the budget.

    Returns:
        list[list[int]]: Units of sequence indices that fit the budget with their prompt once;
        every index exactly once.

    Raises:
        ValueError: A budget < 1, or a sequence longer than the budget.
    """
    _check_fits(sequences, target_tokens_per_batch, "shared_prompt_units")
    units: list[list[int]] = []
    for group in prompt_groups(sequences):
        if _unit_tokens(sequences, group) <= target_tokens_per_batch:
            units.append(group)
            continue
        room = target_tokens_per_batch - sequences[group[0]].prompt_len
        parts = plan_packs([sequences[i].response_len for i in group], room)
        units.extend(sorted(group[j] for j in part) for part in parts)
    return units


def pack_sequences(
    sequences: Sequence[UnscoredTrajectory] | Sequence[ScoredTrajectory],
    device: torch.device | str,
    pad_token_id: int,
    ignore_index: int = -100,
    target_tokens_per_batch: int | None = None,
    mask_kind: str = "dense",
    pad_to_multiple_of: int | None = None,
    share_prompts: bool = False,
) -> PackedTrajectory:
    """Concatenate sequences into one block-causal row ``[P1 R1 ... Pn Rn PAD...]``.

    Padding, if any, is one block at the tail (``sequence_mask == -1``) attending only within
    itself, so no attention row is empty: to exactly ``target_tokens_per_batch``, or up to the
    next ``pad_to_multiple_of`` (capped at the target when both are given), or none.

    Args:
        sequences: All `UnscoredTrajectory` or all `ScoredTrajectory`.
        ignore_index: Unused; ``targets`` hold response tokens only.
        mask_kind: ``"dense"`` (bool ``[L, L]``), ``"flex"`` (``BlockMask``) or ``"varlen"``
            (`VarlenMask`); the last two need `use_packed_attention` on the model.
        share_prompts: Hold each shared prompt once; per-sequence fields stay in input order.

    Returns:
        PackedTrajectory: ``targets``, ``logit_positions`` and ``behavior_logprobs`` always;
        ``loss_mask`` when a sequence has a ``response_mask``; ``ref_logprobs`` and per-token
        ``advantages`` for `ScoredTrajectory` input.

    Raises:
        ValueError: Empty input, mixed types or devices, a tensor whose length disagrees with
            its ``*_len``, ``prompt_len`` 0, a sequence or pack over the budget, or an
            unknown ``mask_kind``.
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(
            f"pack_sequences: mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}"
        )
    is_scored = _check_sequences(sequences)
    device = torch.device(device)
    if target_tokens_per_batch is not None:
        _check_fits(sequences, target_tokens_per_batch, "pack_sequences")
    num_sequences = len(sequences)
    groups = prompt_groups(sequences) if share_prompts else [[i] for i in range(num_sequences)]

    # A block is a whole sequence ``P R``, a shared prompt ``P``, or one response after it;
    # block_prefix is the block it also sees in full (-1: none).
    block_lens_list: list[int] = []
    block_prefix: list[int] = []
    block_first_position: list[int] = []
    block_response_from: list[int] = []
    block_sequence: list[int] = []
    pieces: list[torch.Tensor] = []
    response_starts = [0] * num_sequences
    first_logit_rows = [0] * num_sequences
    spans = [(0, 0)] * num_sequences
    offset = 0

    def add_block(length: int, prefix: int, first_position: int, prompt_len: int, owner: int):
        block_lens_list.append(length)
        block_prefix.append(prefix)
        block_first_position.append(first_position)
        block_response_from.append(prompt_len)
        block_sequence.append(owner)

    for group in groups:
        first = sequences[group[0]]
        prompt_len = first.prompt_len
        if len(group) == 1:
            index = group[0]
            add_block(first.total_len, -1, 0, prompt_len, index)
            pieces += [first.prompt_tokens, first.response_tokens]
            response_starts[index] = offset + prompt_len
            first_logit_rows[index] = offset + prompt_len - 1
            spans[index] = (offset, offset + first.total_len)
            offset += first.total_len
            continue
        prompt_block = len(block_lens_list)
        add_block(prompt_len, -1, 0, prompt_len, group[0])
        pieces.append(first.prompt_tokens)
        offset += prompt_len
        last_prompt_row = offset - 1
        for index in group:
            seq = sequences[index]
            response_starts[index] = offset
            first_logit_rows[index] = last_prompt_row
            spans[index] = (offset, offset + seq.response_len)
            if seq.response_len:  # an empty response is no block
                add_block(seq.response_len, prompt_block, prompt_len, prompt_len, index)
                pieces.append(seq.response_tokens)
                offset += seq.response_len
    total_tokens = offset
    shared_prompt_tokens = sum(seq.total_len for seq in sequences) - total_tokens

    if target_tokens_per_batch is not None and total_tokens > target_tokens_per_batch:
        raise ValueError(
            f"pack_sequences: {num_sequences} sequences hold {total_tokens} tokens, more "
            f"than target_tokens_per_batch={target_tokens_per_batch}; split them with "
            "plan_sequence_packs (or plan_packs)"
        )
    packed_seq_len = _padded_length(total_tokens, target_tokens_per_batch, pad_to_multiple_of)
    num_padding = packed_seq_len - total_tokens

    source_device = sequences[0].prompt_tokens.device
    if num_padding:
        pieces.append(torch.full((num_padding,), pad_token_id, device=source_device))
        # The padding block's "prompt" is all of it, so none of it counts as response.
        add_block(num_padding, -1, 0, num_padding, -1)
    tokens = torch.cat([piece.long() for piece in pieces]).to(device)

    def long_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    prompt_lens = long_tensor([seq.prompt_len for seq in sequences])
    response_lens = long_tensor([seq.response_len for seq in sequences])
    block_lens = long_tensor(block_lens_list)
    block_starts = torch.cumsum(block_lens, dim=0) - block_lens
    block_ids = torch.repeat_interleave(
        torch.arange(len(block_lens_list), device=device), block_lens
    )
    positions = torch.arange(packed_seq_len, device=device)
    position_ids = (
        positions - block_starts[block_ids] + long_tensor(block_first_position)[block_ids]
    )
    sequence_mask = long_tensor(block_sequence)[block_ids]
    response_mask = position_ids >= long_tensor(block_response_from)[block_ids]
    sequence_map = long_tensor([list(span) for span in spans]).reshape(num_sequences, 2)

    # Response token k is predicted by the row before it; k = 0 by the (shared) last prompt token.
    num_response_tokens = int(sum(seq.response_len for seq in sequences))
    sequence_of_token = torch.repeat_interleave(
        torch.arange(num_sequences, device=device), response_lens
    )
    first_token = torch.cumsum(response_lens, dim=0) - response_lens
    token_index = torch.arange(num_response_tokens, device=device) - first_token[sequence_of_token]
    logit_positions = torch.where(
        token_index == 0,
        long_tensor(first_logit_rows)[sequence_of_token],
        long_tensor(response_starts)[sequence_of_token] + token_index - 1,
    )

    def flat(name: str) -> torch.Tensor:
        values = torch.cat([getattr(seq, name).float() for seq in sequences])
        return values.to(device)

    targets = torch.cat([seq.response_tokens.long() for seq in sequences]).to(device)
    behavior_logprobs = flat("logprobs")
    # Environment tokens stay in the sequence (later turns attend to them) but are not trained.
    loss_mask = None
    if any(seq.response_mask is not None for seq in sequences):
        loss_mask = torch.cat(
            [
                seq.response_mask
                if seq.response_mask is not None
                else torch.ones(seq.response_len, dtype=torch.bool, device=source_device)
                for seq in sequences
            ]
        ).to(device)
    ref_logprobs = advantages = None
    if is_scored:
        # A run without a reference model (kl_coeff 0) scores every sequence without one.
        with_ref = [seq.ref_logprobs is not None for seq in sequences]
        if any(with_ref) and not all(with_ref):
            raise ValueError(
                "pack_sequences: some sequences have ref_logprobs and others None "
                f"(sequence_id={sequences[with_ref.index(False)].sequence_id!r} has none)"
            )
        ref_logprobs = flat("ref_logprobs") if all(with_ref) else None
        advantages = torch.cat(
            [seq.token_advantages.to(dtype=torch.float32) for seq in sequences]
        ).to(device)

    has_prefix = any(prefix >= 0 for prefix in block_prefix)
    prefix_ids = long_tensor(block_prefix)[block_ids] if has_prefix else None
    if mask_kind == "dense":
        same_block = block_ids[:, None] == block_ids[None, :]
        attention_mask = same_block & (positions[:, None] >= positions[None, :])
        if prefix_ids is not None:
            attention_mask |= prefix_ids[:, None] == block_ids[None, :]
    elif mask_kind == "flex":
        attention_mask = _block_causal_block_mask(block_ids, prefix_ids, device)
    else:
        attention_mask = VarlenMask(
            tuple(block_lens_list), tuple(block_prefix) if has_prefix else ()
        )

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
        logit_positions=logit_positions,
        shared_prompt_tokens=shared_prompt_tokens,
        loss_mask=loss_mask,
    )


def unpack_response_logprobs(
    packed: PackedTrajectory, packed_logprobs: torch.Tensor
) -> list[torch.Tensor]:
    """Split per-response-token values of a pack back into one tensor per sequence.

    Args:
        packed_logprobs: Shape ``(packed.num_response_tokens,)``, aligned with ``targets``.

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


def packed_forward_inputs(packed: PackedTrajectory) -> dict[str, Any]:
    """Keyword arguments for a torchtune ``TransformerDecoder`` forward over a pack.

    Returns:
        dict: ``tokens`` ``[1, L]``, ``mask`` (dense ``[1, L, L]``, or the pack's
        ``BlockMask``/`VarlenMask` as is) and ``input_pos`` ``[1, L]`` (the RoPE rows).
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

    Deterministic (ties: lower index first).

    Args:
        groups: One hashable group id per item; a group is never split across packs unless
            it alone exceeds the budget.

    Returns:
        list[list[int]]: Item indices of each pack, every index exactly once; within a pack
        the items of a group are contiguous and in input order.

    Raises:
        ValueError: Budget < 1, a negative length, ``groups`` of another length, or an item
            longer than the budget (named by index and length).
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


def plan_sequence_packs(
    sequences: Sequence[Any],
    target_tokens_per_batch: int,
    *,
    share_prompts: bool = False,
    keep_groups_together: bool = False,
) -> list[list[int]]:
    """Assign trajectories to packs of at most ``target_tokens_per_batch`` tokens.

    Args:
        keep_groups_together: Never split a ``group_id`` across packs unless it alone
            exceeds the budget.

    Returns:
        list[list[int]]: Sequence indices of each pack; every index exactly once.

    Raises:
        ValueError: A budget < 1, or a sequence longer than the budget.
    """
    _check_fits(sequences, target_tokens_per_batch, "plan_sequence_packs")
    if not share_prompts:
        return plan_packs(
            [seq.total_len for seq in sequences],
            target_tokens_per_batch,
            groups=[seq.group_id for seq in sequences] if keep_groups_together else None,
        )
    units = shared_prompt_units(sequences, target_tokens_per_batch)
    plan = plan_packs(
        [_unit_tokens(sequences, unit) for unit in units],
        target_tokens_per_batch,
        groups=[sequences[unit[0]].group_id for unit in units] if keep_groups_together else None,
    )
    return [[index for unit in pack for index in units[unit]] for pack in plan]


def shard_batch(
    sequences: Sequence[Any],
    world_size: int,
    target_tokens_per_batch: int,
    *,
    share_prompts: bool = False,
) -> list[list[int]]:
    """Split a batch over ``world_size`` data-parallel ranks; the same answer on every rank.

    Without ``share_prompts``: round robin. With it, whole `shared_prompt_units` go to the
    rank with the fewest tokens so far, halving units while there are fewer than ranks.
    Deterministic, so ranks agree on the micro-batch count without communicating.

    Returns:
        list[list[int]]: Per rank, the indices of its sequences, in input order.

    Raises:
        ValueError: ``world_size`` < 1, and as `shared_prompt_units`.
    """
    if world_size < 1:
        raise ValueError(f"shard_batch: world_size must be >= 1, got {world_size}")
    if not share_prompts:
        return [list(range(rank, len(sequences), world_size)) for rank in range(world_size)]
    units = shared_prompt_units(sequences, target_tokens_per_batch)
    while len(units) < world_size:
        splittable = [u for u in range(len(units)) if len(units[u]) > 1]
        if not splittable:
            break  # fewer sequences than ranks: some ranks get none
        largest = max(splittable, key=lambda u: (_unit_tokens(sequences, units[u]), -u))
        unit = units.pop(largest)
        half = len(unit) // 2
        units[largest:largest] = [unit[:half], unit[half:]]
    costs = [_unit_tokens(sequences, unit) for unit in units]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for unit in sorted(range(len(units)), key=lambda u: (-costs[u], units[u][0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].extend(units[unit])
        loads[rank] += costs[unit]
    return [sorted(shard) for shard in shards]
