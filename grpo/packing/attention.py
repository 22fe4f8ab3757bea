"""Attention for packed sequences in torchtune models, on CPU and GPU.

A pack's block-causal mask (plus, for shared prompts, a response block seeing its whole prompt
block) comes in three forms: ``"dense"`` (bool ``[L, L]``), ``"flex"`` (FlexAttention
``BlockMask``, O(L) memory) and ``"varlen"`` (`VarlenMask`: each block attends alone, blocks of
similar length batched into one SDPA call, or on CPU in bf16/fp16 two matmuls and a softmax).

torchtune sends a mask to SDPA, which cannot serve a ``BlockMask`` or `VarlenMask`, except on
recent CUDA GPUs; `use_packed_attention` swaps in `packed_attention`, which serves all three on
every device. On CPU FlexAttention has no backward (torch 2.13): train there with ``"varlen"``.
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

    Token ``i`` sees ``j`` iff both lie in the same block and ``j <= i``, or ``j`` lies in the
    prefix block of ``i``'s block. Lengths are Python ints to avoid a device sync per layer.

    Args:
        block_lens: Length of each block, in order (a tail padding block is one more).
        prefix_blocks: Empty, or per block the index of an earlier prefix-free block that it
            sees in full, or -1.

    Raises:
        ValueError: If there is no block, a length is not a positive int, or ``prefix_blocks``
            has the wrong length or names a block that is not an earlier prefix-free block.
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
        """The batched-SDPA plan of this mask on ``device``, built once for every layer."""
        plans = self.__dict__.setdefault("_sdpa_plans", {})  # not a field: eq and hash ignore it
        if device not in plans:
            plans[device] = _varlen_buckets(self, device)
        return plans[device]


def resolve_mask_kind(mask_kind: str, device: torch.device | str) -> str:
    """The mask form to pack with: ``"auto"`` is ``"flex"`` on CUDA, ``"varlen"`` elsewhere.

    Raises:
        ValueError: If ``mask_kind`` is not one of `MASK_KIND_CHOICES`.
    """
    if mask_kind not in MASK_KIND_CHOICES:
        raise ValueError(f"mask_kind must be one of {MASK_KIND_CHOICES}, got {mask_kind!r}")
    if mask_kind != "auto":
        return mask_kind
    return "flex" if torch.device(device).type == "cuda" else "varlen"


_compiled_flex_attention: dict[str, Callable] = {}


def _get_compiled_flex_attention(device_type: str) -> Callable:
    """Compile FlexAttention once per process and device type (uncompiled it builds the scores).

    CPU compiles statically, once per pack length: in torch 2.13 inductor's dynamic-shape CPU
    template emits C++ that does not build ("'cur_qSplitSize8' was not declared"). After 8
    lengths dynamo falls back to the uncompiled path, hence the padding of flex packs.
    """
    if device_type not in _compiled_flex_attention:
        dynamic = False if device_type == "cpu" else None
        _compiled_flex_attention[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex_attention[device_type]


# FlexAttention's block size: flex packs are padded to a multiple of it (`FLEX_BUCKET`).
FLEX_BLOCK_SIZE = 128


def flex_kernel_options(device_type: str, q_len: int, kv_len: int) -> dict[str, bool] | None:
    """FlexAttention kernel options for lengths ``q_len`` and ``kv_len`` on ``device_type``.

    Compiled for dynamic lengths (CUDA, from the second pack length on), inductor cannot prove
    that a length is a multiple of the block size and keeps the kernel's bounds checks; a
    padded pack is one, and says so (``IS_DIVISIBLE``, what a static compile infers). On an
    H200, forward and backward over a 16k-token GRPO pack (16 heads of 128) took 1.8 ms so,
    2.9 ms without, 2.0 ms compiled statically (docs/benchmarks.md). CPU compiles statically,
    and infers it.
    """
    if device_type == "cuda" and q_len % FLEX_BLOCK_SIZE == 0 and kv_len % FLEX_BLOCK_SIZE == 0:
        return {"IS_DIVISIBLE": True}
    return None


# Flex attention is only fast compiled, and torch.compile cannot nest: keep it out of any
# compiled region around it (as torchtune does) so a compiled model still uses the kernel.
@torch.compiler.disable(recursive=False)
def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    options = flex_kernel_options(q.device.type, q.shape[-2], k.shape[-2])
    compiled = _get_compiled_flex_attention(q.device.type)
    return compiled(q, k, v, block_mask=block_mask, kernel_options=options)


@dataclass(frozen=True)
class _VarlenBucket:
    """Blocks of similar length, run as one batched SDPA call.

    Padding slots index row ``seq_len``, a zero row. A padding query sees all of the block's
    keys: a fully masked row's softmax, and its backward, would be NaN.
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
    """The buckets of ``mask`` on ``device`` and the permutation back to packed order."""
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


# Traced, the block lengths (new in every pack) would be baked in and recompile each pack.
@torch.compiler.disable(recursive=False)
def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, dropout_p: float
) -> torch.Tensor:
    """Block-causal attention, one batched call per bucket of similar-length blocks
    (`_bucket_attention`).

    A call per block would cost more in overhead than arithmetic; power-of-two buckets at most
    double the ``sum(len_i^2)`` work.
    """
    batch, heads, seq_len, head_dim = q.shape
    if seq_len != mask.seq_len or k.shape[2] != mask.seq_len:
        raise ValueError(
            f"VarlenMask covers {mask.seq_len} tokens but queries have {seq_len} and keys "
            f"{k.shape[2]}; pass the mask built for this pack"
        )
    buckets, inverse = mask.sdpa_plan(q.device)
    # Batch and heads folded into one dim, so the [n, 1, q, k] masks broadcast over both.
    q_rows, k_rows, v_rows = (_token_rows(x) for x in (q, k, v))
    outputs = []
    for bucket in buckets:
        out = _bucket_attention(
            _gather_rows(q_rows, bucket.query_index).transpose(1, 2),  # [n, b * h, q, d]
            _gather_rows(k_rows, bucket.key_index).transpose(1, 2),
            _gather_rows(v_rows, bucket.key_index).transpose(1, 2),
            bucket.attn_mask,
            dropout_p,
        )
        # Back to rows [n * q, b * h, d], real tokens only.
        outputs.append(_gather_rows(out.transpose(1, 2).flatten(0, 1), bucket.token_rows))
    packed = _gather_rows(torch.cat(outputs), inverse).unflatten(1, (batch, heads))  # [s, b, h, d]
    return packed.permute(1, 2, 0, 3)


def _gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for an integer ``index`` of any shape, by ``index_select``: its backward
    (``index_add_``) is about 3x faster on CPU than advanced indexing's (``index_put_``)."""
    return rows.index_select(0, index.flatten()).unflatten(0, index.shape)


# Scores (blocks x heads x queries x keys) that one `_matmul_attention` call builds at most: a
# bucket with more runs in chunks of blocks, and a block with more alone goes to SDPA. Unlike
# flash, the matmul path keeps every score for the backward (6 bytes each); the cap bounds
# that to under 2M / queries x 6 bytes per query token and layer.
MATMUL_ATTENTION_MAX_SCORES = 1 << 21


def _bucket_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """SDPA over one bucket, or `_matmul_attention` where that is faster: on CPU in bf16/fp16.

    torch's CPU flash kernel runs half precision slower than float32, its backward above all:
    1.3-2.7x slower than two bf16 matmuls and a softmax over packs of 16- to 512-token blocks
    (``scripts/bench_attention.py``). Chunks of at most `MATMUL_ATTENTION_MAX_SCORES` scores
    stay in cache (fewer, larger calls were slower). In float32 the flash kernel is as fast.
    """
    scores_per_block = q.shape[1] * q.shape[2] * k.shape[2]
    if (
        q.device.type != "cpu"
        or q.dtype not in (torch.bfloat16, torch.float16)
        or dropout_p
        or scores_per_block > MATMUL_ATTENTION_MAX_SCORES
    ):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    chunk = MATMUL_ATTENTION_MAX_SCORES // scores_per_block  # blocks per call
    outputs = [
        _matmul_attention(
            q[i : i + chunk], k[i : i + chunk], v[i : i + chunk], attn_mask[i : i + chunk]
        )
        for i in range(0, q.shape[0], chunk)
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor
) -> torch.Tensor:
    """Attention as written (scores, masked float32 softmax, weighted sum), as HF's eager path.

    Every query row must see at least one key (a fully masked row is NaN, as in SDPA).
    """
    scores = q @ k.transpose(-1, -2)
    scores = scores.mul_(q.shape[-1] ** -0.5).masked_fill_(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


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

    The signature of torchtune's ``MultiHeadAttention._attention_call``.

    Args:
        q: Queries ``[b, n_heads, s, head_dim]``.
        k, v: Keys and values, expanded for grouped-query attention.
        mask: ``None`` (causal if ``is_causal``), a bool ``[b, s, s]`` tensor (True = may
            attend), a ``BlockMask`` or a `VarlenMask`.
        dropout_p: Attention dropout; FlexAttention supports none.

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

    Idempotent, in place; returns ``model``. Dense masks take the same path as before.

    Raises:
        ValueError: If the model has no torchtune ``MultiHeadAttention``.
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
