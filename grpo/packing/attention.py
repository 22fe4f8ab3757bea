"""Attention for packed sequences in torchtune models, on CPU and GPU.

A pack ``[P1 R1 P2 R2 ... PAD]`` needs block-causal attention: a token sees earlier tokens of its
own sequence only. `grpo.packing.packs.pack_sequences` describes that mask in one of three forms:

- ``"dense"``: a bool ``[L, L]`` tensor (True = may attend). Works with stock torchtune on any
  device, but costs O(L^2) memory and SDPA computes every masked-out block anyway.
- ``"flex"``: a FlexAttention ``BlockMask``, O(L) memory, and fully masked blocks are skipped.
- ``"varlen"``: a `VarlenMask` holding the block lengths; attention runs on each block alone,
  blocks of similar length batched into one SDPA call, so compute is about ``sum(len_i^2)``
  instead of ``L^2``.

Shared-prompt packs (``[P R1 R2 ... RG]``, see `grpo.packing.packs`) add one rule to the block-causal
one: a response block also sees every token of its prompt block. All three forms express it:
the dense mask and the flex ``mask_mod`` from per-token block ids, and `VarlenMask` through
``prefix_blocks``.

Why this module exists: torchtune 0.6.1 chooses its attention function once, when each
``MultiHeadAttention`` is built (``_sdpa_or_flex_attention``), and uses FlexAttention only when
``torchtune.utils._import_guard._SUPPORTS_FLEX_ATTENTION`` holds, which requires CUDA with compute
capability >= 7.5. On CPU it sends every mask to SDPA as ``mask[:, None, :, :]``, which a
``BlockMask`` or a `VarlenMask` cannot serve. `use_packed_attention` replaces that function on
each attention module of a model with `packed_attention`, which understands all three forms on
every device and otherwise behaves exactly like torchtune's (SDPA for tensors and ``None``).

FlexAttention on CPU: torch 2.13 runs it forward only (it raises "FlexAttention does not support
backward on CPU" when an input requires grad), and compiles it once per pack length (see
`_get_compiled_flex_attention`), so pad flex packs to a bucket. Use ``"flex"`` on CPU for no-grad
forwards such as the reference model, and ``"varlen"`` (or ``"dense"``) to train on CPU.
FlexAttention is always run compiled: uncompiled it materialises the full score matrix, which
defeats its purpose.

Which to use: on CUDA, ``"flex"``; on CPU, ``"varlen"`` (fastest there, and the only one of the
two block-sparse forms with a backward); ``"dense"`` anywhere as the simple reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from grpo.choices import MASK_KIND_CHOICES

__all__ = [
    "MASK_KIND_CHOICES",
    "VarlenMask",
    "packed_attention",
    "resolve_mask_kind",
    "use_packed_attention",
]


@dataclass(frozen=True)
class VarlenMask:
    """Block-causal mask given by the lengths of consecutive blocks of one packed row.

    Token ``i`` may attend to token ``j`` iff both lie in the same block and ``j <= i``, or
    ``j`` lies in the prefix block of ``i``'s block (``prefix_blocks``): a shared prompt that a
    response block sees in full. The lengths are Python ints: attention splits on them in
    every layer, and ints avoid a device-to-host sync per layer.

    Args:
        block_lens (tuple[int, ...]): Length of each block, in order; they sum to the packed
            length. A tail padding block is one more block.
        prefix_blocks (tuple[int, ...]): Empty (no block has a prefix), or one entry per block:
            the index of an earlier block that the block sees in full, or -1. A prefix block
            has no prefix of its own.

    Raises:
        ValueError: If there is no block, a length is not a positive int, or ``prefix_blocks``
            has the wrong length or names a block that is not an earlier prefix-free block.

    Example:
        >>> VarlenMask((3, 2)).seq_len  # tokens 0-2 see each other causally, tokens 3-4 too
        5
        >>> shared = VarlenMask((3, 2, 4), prefix_blocks=(-1, 0, 0))  # [P R1 R2]
    """

    block_lens: tuple[int, ...]
    prefix_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.block_lens:
            raise ValueError("VarlenMask: block_lens is empty")
        for index, length in enumerate(self.block_lens):
            if not isinstance(length, int) or length < 1:
                raise ValueError(
                    f"VarlenMask: block_lens[{index}] must be a positive int, got {length!r}"
                )
        if not self.prefix_blocks:
            return
        if len(self.prefix_blocks) != len(self.block_lens):
            raise ValueError(
                f"VarlenMask: {len(self.prefix_blocks)} prefix_blocks for "
                f"{len(self.block_lens)} blocks"
            )
        for index, prefix in enumerate(self.prefix_blocks):
            if prefix == -1:
                continue
            if not isinstance(prefix, int) or not 0 <= prefix < index:
                raise ValueError(
                    f"VarlenMask: prefix_blocks[{index}] must be -1 or an earlier block index, "
                    f"got {prefix!r}"
                )
            if self.prefix_blocks[prefix] != -1:
                raise ValueError(
                    f"VarlenMask: prefix_blocks[{index}] names block {prefix}, which has a "
                    "prefix itself"
                )

    @property
    def seq_len(self) -> int:
        """Total length of the packed row."""
        return sum(self.block_lens)

    def sdpa_plan(self, device: torch.device) -> tuple[list[_VarlenBucket], torch.Tensor]:
        """The gather indices and masks `packed_attention` runs this mask with, on ``device``.

        Built on first use and kept: every layer, forward and backward, uses the same plan.
        """
        plans = self.__dict__.setdefault("_sdpa_plans", {})  # not a field: eq and hash ignore it
        if device not in plans:
            plans[device] = _varlen_buckets(self, device)
        return plans[device]


# What a config may ask for: a concrete form, or "auto" for the fastest one on the device.


def resolve_mask_kind(mask_kind: str, device: torch.device | str) -> str:
    """The mask form to pack with: ``"auto"`` becomes the fastest form on ``device``.

    ``"auto"`` is ``"flex"`` on CUDA (block-sparse kernel, O(L) memory) and ``"varlen"``
    elsewhere: on CPU a dense ``[L, L]`` mask makes SDPA compute every cross-sequence block
    (work and memory grow with the square of the pack), and FlexAttention has no backward
    there.

    Args:
        mask_kind (str): One of `MASK_KIND_CHOICES`.
        device (torch.device | str): Where the model runs.

    Returns:
        str: ``"dense"``, ``"varlen"`` or ``"flex"``.

    Raises:
        ValueError: If ``mask_kind`` is not one of `MASK_KIND_CHOICES`.

    Example:
        >>> resolve_mask_kind("auto", "cpu")
        'varlen'
    """
    if mask_kind not in MASK_KIND_CHOICES:
        raise ValueError(f"mask_kind must be one of {MASK_KIND_CHOICES}, got {mask_kind!r}")
    if mask_kind != "auto":
        return mask_kind
    return "flex" if torch.device(device).type == "cuda" else "varlen"


_compiled_flex_attention: dict[str, Callable] = {}


def _get_compiled_flex_attention(device_type: str) -> Callable:
    """Compile FlexAttention once per process and device type, on first use.

    CPU: ``dynamic=False``, one static compile per distinct pack length (a few seconds each on
    a small CPU). Dynamic-shape kernels are not an option there in torch 2.13: after a change
    in the number of 128-token mask blocks, inductor's CPU FlexAttention template generates
    C++ that does not build ("'cur_qSplitSize8' was not declared"), both with ``dynamic=True``
    and with the default automatic-dynamic recompile. After
    ``torch._dynamo.config.recompile_limit`` (8) distinct lengths, dynamo runs FlexAttention
    uncompiled (correct, but it materialises the score matrix and warns), so keep the number
    of lengths small: pad flex packs to a bucket (``pad_to_multiple_of``) or to the budget.

    Other devices: torch.compile's default, i.e. static first and one dynamic-shape recompile
    when a second length appears.
    """
    if device_type not in _compiled_flex_attention:
        dynamic = False if device_type == "cpu" else None
        _compiled_flex_attention[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex_attention[device_type]


# Flex attention is only fast compiled, and torch.compile cannot nest: keep it out of any
# compiled region around it (as torchtune does) so a compiled model still uses the kernel.
@torch.compiler.disable(recursive=False)
def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    return _get_compiled_flex_attention(q.device.type)(q, k, v, block_mask=block_mask)


@dataclass(frozen=True)
class _VarlenBucket:
    """Blocks of similar length, run as one batched SDPA call.

    ``query_index`` ``[n, q]`` and ``key_index`` ``[n, p + q]`` pick each block's query rows
    and its keys (prefix rows, then its own rows) out of the packed row; padding slots point
    at row ``seq_len``, an extra zero row. ``attn_mask`` ``[n, 1, q, p + q]`` lets query ``i``
    see its prefix and its own keys ``0..i``; a padding query (``i`` past the block's end)
    sees all of the block's keys, so no row is fully masked (its softmax would be NaN, and
    so would the backward). ``token_rows`` are the flat positions in ``query_index`` of the
    real tokens, in the order `VarlenMask.sdpa_plan`'s inverse permutation expects.
    """

    query_index: torch.Tensor
    key_index: torch.Tensor
    attn_mask: torch.Tensor
    token_rows: torch.Tensor


def _bucket_of(length: int) -> int:
    """Blocks whose lengths round up to the same power of two (at least 16) share a call."""
    return max(16, 1 << (length - 1).bit_length())


def _varlen_buckets(
    mask: VarlenMask, device: torch.device
) -> tuple[list[_VarlenBucket], torch.Tensor]:
    """The batched-SDPA plan of ``mask`` on ``device`` (built on CPU, then moved), and the
    permutation that puts the buckets' output rows (bucket by bucket, block by block) back in
    packed order."""
    lens = torch.tensor(mask.block_lens)
    starts = lens.cumsum(0) - lens
    prefixes = torch.tensor(mask.prefix_blocks or (-1,) * len(mask.block_lens))
    has_prefix = prefixes >= 0
    prefix_lens = torch.where(has_prefix, lens[prefixes.clamp(min=0)], 0)
    prefix_starts = starts[prefixes.clamp(min=0)]
    pad_row = mask.seq_len
    by_bucket: dict[int, list[int]] = {}
    for block, length in enumerate(mask.block_lens):
        by_bucket.setdefault(_bucket_of(length), []).append(block)
    buckets, order = [], []
    for blocks in by_bucket.values():
        index = torch.tensor(blocks)
        own_lens, own_starts = lens[index, None], starts[index, None]
        pre_lens, pre_starts = prefix_lens[index, None], prefix_starts[index, None]
        q_len, p_len = int(own_lens.max()), int(pre_lens.max())
        slots = torch.arange(q_len)
        real = slots < own_lens  # [n, q]
        query_index = torch.where(real, own_starts + slots, pad_row)
        prefix_slots = torch.arange(p_len)
        prefix_index = torch.where(prefix_slots < pre_lens, pre_starts + prefix_slots, pad_row)
        key_index = torch.cat([prefix_index, query_index], dim=1)
        sees_prefix = (prefix_slots < pre_lens)[:, None, :].expand(-1, q_len, -1)
        sees_own = (slots[None, None, :] <= slots[None, :, None]) & real[:, None, :]
        attn_mask = torch.cat([sees_prefix, sees_own], dim=2)[:, None]
        token_rows = real.flatten().nonzero().squeeze(1)
        parts = (query_index, key_index, attn_mask, token_rows)
        buckets.append(_VarlenBucket(*(part.to(device) for part in parts)))
        order.append(query_index[real])
    inverse = torch.empty(mask.seq_len, dtype=torch.long)
    inverse[torch.cat(order)] = torch.arange(mask.seq_len)
    return buckets, inverse.to(device)


# The block lengths differ in every pack: traced by dynamo they would be baked into the graph
# and recompile it for each pack. A compiled layer (training.compile) breaks its graph here.
@torch.compiler.disable(recursive=False)
def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, dropout_p: float
) -> torch.Tensor:
    """Block-causal attention with one batched SDPA call per bucket of similar-length blocks.

    A pack of 64 short sequences has 64 blocks or more; an SDPA call per block (and its
    backward) costs more in per-call overhead than in arithmetic. Blocks whose lengths round up
    to the same power of two are padded to the longest of them and run together, so a layer
    makes a handful of calls, and padding at most doubles the ``sum(len_i^2)`` work. A block
    with a prefix block (a response after its shared prompt) has the prefix's rows then its
    own as keys: query ``i`` sees the whole prefix and its own keys ``0..i``, exactly the keys
    it has when the prompt and the response run alone as one sequence.
    """
    batch, heads, seq_len, head_dim = q.shape
    if seq_len != mask.seq_len or k.shape[2] != mask.seq_len:
        raise ValueError(
            f"VarlenMask covers {mask.seq_len} tokens but queries have {seq_len} and keys "
            f"{k.shape[2]}; pass the mask built for this pack"
        )
    buckets, inverse = mask.sdpa_plan(q.device)
    # Rows [s + 1, b * h, d]: one index picks a token's vectors in every head (batch and heads
    # folded, so the [n, 1, q, k] masks broadcast over both); padding slots read the zero row.
    q_rows, k_rows, v_rows = (_token_rows(x) for x in (q, k, v))
    outputs = []
    for bucket in buckets:
        out = F.scaled_dot_product_attention(
            q_rows[bucket.query_index].transpose(1, 2),  # [n, b * h, q, d]
            k_rows[bucket.key_index].transpose(1, 2),
            v_rows[bucket.key_index].transpose(1, 2),
            attn_mask=bucket.attn_mask,
            dropout_p=dropout_p,
        )
        # Back to rows [n * q, b * h, d], real tokens only.
        outputs.append(out.transpose(1, 2).flatten(0, 1)[bucket.token_rows])
    packed = torch.cat(outputs)[inverse].unflatten(1, (batch, heads))  # [s, b, h, d]
    return packed.permute(1, 2, 0, 3)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, h, s, d]`` as rows ``[s + 1, b * h, d]``, the last row zeros."""
    batch, heads, seq_len, head_dim = x.shape
    rows = x.permute(2, 0, 1, 3).reshape(seq_len, batch * heads, head_dim)
    return torch.cat([rows, rows.new_zeros(1, batch * heads, head_dim)])


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | VarlenMask | None,
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """Attention that honours every mask form `pack_sequences` builds, on any device.

    Same signature as the function torchtune's ``MultiHeadAttention`` stores in
    ``_attention_call``; q, k and v arrive as ``[b, n_heads, s, head_dim]`` (k and v already
    expanded for grouped-query attention).

    Args:
        q (torch.Tensor): Queries.
        k (torch.Tensor): Keys.
        v (torch.Tensor): Values.
        mask: ``None`` (causal if ``is_causal``), a bool ``[b, s, s]`` tensor (True = may
            attend), a FlexAttention ``BlockMask`` or a `VarlenMask`.
        dropout_p (float): Attention dropout; FlexAttention supports none.
        is_causal (bool): Causal masking when ``mask`` is ``None``.

    Returns:
        torch.Tensor: ``[b, n_heads, s, head_dim]``.

    Raises:
        ValueError: Dropout with a ``BlockMask``, or a `VarlenMask` of the wrong length.
        NotImplementedError: A ``BlockMask`` on CPU with gradients required.
    """
    if isinstance(mask, VarlenMask):
        return _varlen_attention(q, k, v, mask, dropout_p)
    if isinstance(mask, BlockMask):
        if dropout_p > 0.0:
            raise ValueError(f"FlexAttention does not support dropout, got dropout_p={dropout_p}")
        needs_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        )
        if q.device.type == "cpu" and needs_grad:
            raise NotImplementedError(
                f"FlexAttention has no CPU backward in torch {torch.__version__}: run this "
                "forward under torch.no_grad(), or pack with mask_kind='varlen' (or 'dense') "
                "to train on CPU"
            )
        return _flex_attention(q, k, v, mask)
    if mask is not None:
        mask = mask[:, None, :, :]  # broadcast over heads, as torchtune does
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
    )


def use_packed_attention(model: nn.Module) -> nn.Module:
    """Make every torchtune attention module of ``model`` use `packed_attention`.

    Needed for ``"varlen"`` masks on every device and for ``"flex"`` masks on CPU (stock
    torchtune 0.6.1 handles ``BlockMask`` on CUDA only); harmless for dense masks, whose path is
    unchanged. Idempotent; modifies ``model`` in place.

    Args:
        model (nn.Module): A model containing torchtune ``MultiHeadAttention`` modules.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        ValueError: If the model has no torchtune ``MultiHeadAttention``.

    Example:
        >>> model = use_packed_attention(qwen2(...))
        >>> logits = model(**packed_forward_inputs(pack_sequences(seqs, "cpu", 0, mask_kind="varlen")))
    """
    from torchtune.modules import MultiHeadAttention

    num_patched = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            # An instance attribute set in MultiHeadAttention.__init__, not a submodule.
            module._attention_call = packed_attention
            num_patched += 1
    if num_patched == 0:
        raise ValueError(
            f"use_packed_attention: {type(model).__name__} contains no torchtune "
            "MultiHeadAttention module"
        )
    return model
