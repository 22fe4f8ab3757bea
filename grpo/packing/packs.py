"""Sequence packing: many unpadded sequences in one block-causal row.

``[P1 R1 P2 R2 ... Pn Rn PAD...]``: prompts and responses are concatenated without padding
between them; padding, when asked for, is one extra block at the tail. Position ids restart at 0
for every sequence and the attention mask is block-causal, so each sequence sees exactly what it
would see alone: its logprobs do not depend on what it is packed with.

Shared prompts (``share_prompts=True``): the G responses of one GRPO group answer the same
prompt, so a pack can hold it once, ``[P R1 R2 ... RG]``. Response ``Rj`` attends to all of
``P`` and causally to its own tokens (never to another response), with position ids
``prompt_len + k`` as if it ran alone; the logprob of its first token is read from ``P``'s last
token, shared by the G responses. Every response's logprobs, and the gradients of a loss, are
the same as without sharing up to fp32 rounding. Sequences share a prompt only when they have
the same ``group_id`` AND identical prompt tokens (`prompt_groups`); a prompt group that does
not fit the budget is split into sub-groups, each with its own copy of the prompt
(`shared_prompt_units`). Sharing is planned and laid out here only: `plan_sequence_packs`,
`shard_batch` and `pack_sequences` take the same ``share_prompts`` flag.

The logprob of a response token is read from the hidden row at the pack's ``logit_positions``
(the previous token of its sequence); ``targets`` are the response tokens in sequence order,
so ``hidden[logit_positions]`` lines up with them. `grpo.packing.logprobs` does the gather.

Every per-token tensor is built with vectorised ops (``repeat_interleave``, ``cumsum``,
comparisons of block ids); Python loops run over sequences, never over tokens.

Pure torch: no Ray, no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from grpo.packing.attention import VarlenMask
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

# What the actors pad flex packs to a multiple of (``pad_to_multiple_of``). FlexAttention is
# compiled once per pack length (on CPU a static compile each, and after 8 lengths dynamo falls
# back to the slow uncompiled path; see `grpo.packing.attention`), so flex packs must take few distinct
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
    """Indices of the sequences that can share one prompt: same ``group_id``, same prompt.

    Prompt tokens are compared, not only group ids: two sequences of one group with different
    prompts (e.g. a dataset that reuses ids) never share.

    Args:
        sequences (Sequence): Trajectories with ``group_id``, ``prompt_len`` and
            ``prompt_tokens`` (one device).

    Returns:
        list[list[int]]: One list per distinct (group_id, prompt), in order of first
        appearance; each in input order. Every index appears exactly once.

    Example:
        >>> prompt_groups(batch)  # two groups of 3 responses, interleaved
        [[0, 2, 4], [1, 3, 5]]
    """
    groups: list[list[int]] = []
    # (group_id, prompt_len) -> indices into `groups` of the prompts seen with that key.
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
    """Prompt groups (`prompt_groups`), each split to fit the budget with its prompt once.

    A prompt group whose prompt plus responses exceed ``target_tokens_per_batch`` is split
    into sub-groups (first-fit decreasing of the responses into ``budget - prompt_len``), each
    of which gets its own copy of the prompt.

    Args:
        sequences (Sequence): Trajectories (see `prompt_groups`).
        target_tokens_per_batch (int): Token budget of a pack.

    Returns:
        list[list[int]]: Units of sequence indices (each in input order) that fit the budget
        when packed with their prompt once; every index exactly once.

    Raises:
        ValueError: A budget < 1, or a sequence longer than the budget.
    """
    _check_fits(sequences, target_tokens_per_batch, "shared_prompt_units")
    units: list[list[int]] = []
    for group in prompt_groups(sequences):
        if _unit_tokens(sequences, group) <= target_tokens_per_batch:
            units.append(group)
            continue
        # Splitting only happens when some response is non-empty, so the room is >= 1.
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

    With ``share_prompts``, the sequences of each `prompt_groups` group with more than one
    member are laid out as ``[P R1 R2 ... RG]`` instead (see the module docstring), at the
    place of the group's first sequence; ``targets`` and every per-sequence field stay in
    input order.

    Padding, if any, is one extra block at the tail (``sequence_mask == -1``, its own position
    ids from 0, attending only within itself so no attention row is empty). Sequences are never
    padded inside. Tail padding rules:

    - ``target_tokens_per_batch`` alone: pad to exactly that many tokens (a static shape).
    - ``pad_to_multiple_of`` alone: pad up to the next multiple (few distinct shapes, little
      padding).
    - both: the next multiple, capped at ``target_tokens_per_batch``.
    - neither: no padding.

    ``target_tokens_per_batch`` is also the budget: a pack longer than it is an error (split the
    batch with `plan_sequence_packs` first).

    Args:
        sequences: Sequences to pack, all `UnscoredTrajectory` or all `ScoredTrajectory`.
        device (torch.device | str): Device of the packed tensors (and of the mask).
        pad_token_id (int): Token id used for tail padding.
        ignore_index (int): Accepted for callers that pass a loss ignore index; ``targets``
            hold response tokens only, so no position is filled with it.
        target_tokens_per_batch (int | None): Token budget of the pack; see above.
        mask_kind (str): ``"dense"`` (bool ``[L, L]``, True = may attend), ``"flex"``
            (FlexAttention ``BlockMask``) or ``"varlen"`` (`grpo.packing.attention.VarlenMask`).
            ``"flex"`` and ``"varlen"`` need `grpo.packing.attention.use_packed_attention` on the model
            on CPU (``"varlen"`` on every device). On CPU FlexAttention has no backward and
            compiles once per pack length: give flex packs a ``pad_to_multiple_of``.
        pad_to_multiple_of (int | None): Bucket size for tail padding; see above.
        share_prompts (bool): Hold each shared prompt once (see above).

    Returns:
        PackedTrajectory: ``targets``, ``logit_positions`` and ``behavior_logprobs`` (the
        sequences' ``logprobs``) are always filled; ``loss_mask`` when a sequence has a
        ``response_mask`` (multi-turn episodes); ``ref_logprobs`` and per-token
        ``advantages`` (a sequence's scalar advantage repeated over its response, or its
        per-token advantages as they are) only for `ScoredTrajectory` input;
        ``shared_prompt_tokens`` counts the prompt tokens not repeated.

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
    if target_tokens_per_batch is not None:
        _check_fits(sequences, target_tokens_per_batch, "pack_sequences")
    num_sequences = len(sequences)
    groups = prompt_groups(sequences) if share_prompts else [[i] for i in range(num_sequences)]

    # The layout, block by block. A block is a whole sequence ``P R``, a shared prompt ``P``,
    # or one response after a shared prompt. Per block: its length, the block it also sees in
    # full (-1: none), the position id of its first token, and the position id from which its
    # tokens are response tokens.
    block_lens_list: list[int] = []
    block_prefix: list[int] = []
    block_first_position: list[int] = []
    block_response_from: list[int] = []
    block_sequence: list[int] = []
    pieces: list[torch.Tensor] = []
    # Per sequence: where its response starts, the row that predicts its first response token,
    # and the [start, end) of its own tokens.
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

    # Tokens: one cat where the sequences live, then a single move to the device.
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

    # The row predicting response token k of a sequence: the previous token of its response,
    # and for k = 0 the last prompt token (shared by every response of a shared prompt).
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
    # Environment tokens of multi-turn episodes stay in the sequence (the policy's later turns
    # attend to them) but are not trained: the loss reads this mask.
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
        # A scalar advantage (GRPO) covers its whole response; distillation's are per token.
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
        packed (PackedTrajectory): The pack the values were computed on.
        packed_logprobs (torch.Tensor): Shape ``(packed.num_response_tokens,)``, aligned with
            ``packed.targets`` (e.g. from `grpo.packing.logprobs.model_response_logprobs`).

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


def plan_sequence_packs(
    sequences: Sequence[Any],
    target_tokens_per_batch: int,
    *,
    share_prompts: bool = False,
    keep_groups_together: bool = False,
) -> list[list[int]]:
    """Assign trajectories to packs of at most ``target_tokens_per_batch`` tokens.

    Without ``share_prompts``: `plan_packs` on ``total_len`` (and ``group_id`` with
    ``keep_groups_together``). With it, the units placed are `shared_prompt_units`, each
    costing its prompt once plus its responses, so the packs `pack_sequences` builds with
    ``share_prompts=True`` fit the budget.

    Args:
        sequences (Sequence): Trajectories (`UnscoredTrajectory` or `ScoredTrajectory`).
        target_tokens_per_batch (int): Token budget of a pack.
        share_prompts (bool): Plan for packs that hold each shared prompt once.
        keep_groups_together (bool): Never split a ``group_id`` across packs unless it alone
            exceeds the budget.

    Returns:
        list[list[int]]: Sequence indices of each pack; every index exactly once.

    Raises:
        ValueError: A budget < 1, or a sequence longer than the budget.

    Example:
        >>> plan = plan_sequence_packs(batch, 2048, share_prompts=True)
        >>> packs = [pack_sequences([batch[i] for i in p], "cpu", 0, share_prompts=True) for p in plan]
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

    Without ``share_prompts``: round robin, ``indices[rank::world_size]``. With it, whole
    `shared_prompt_units` go to one rank (a prompt is useless to a rank without its responses),
    largest first to the rank with the fewest tokens so far, which balances tokens. While
    there are fewer units than ranks, the largest unit of several sequences is halved (each
    half with its own prompt), so that every rank gets work when the batch has at least
    ``world_size`` sequences. Deterministic: each rank computes every rank's shard from the
    whole batch, so all agree on the number of micro-batches without communicating.

    Args:
        sequences (Sequence): The whole batch.
        world_size (int): Number of ranks.
        target_tokens_per_batch (int): Token budget of a pack (units are split to fit it).
        share_prompts (bool): Keep shared prompts with their responses.

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
