"""Attention for packed sequences in torchtune models, on CPU and GPU.

A pack ``[P1 R1 P2 R2 ... PAD]`` needs block-causal attention: a token sees earlier tokens of its
own sequence only. `grpo.packing.pack_sequences` describes that mask in one of three forms:

- ``"dense"``: a bool ``[L, L]`` tensor (True = may attend). Works with stock torchtune on any
  device, but costs O(L^2) memory and SDPA computes every masked-out block anyway.
- ``"flex"``: a FlexAttention ``BlockMask``, O(L) memory, and fully masked blocks are skipped.
- ``"varlen"``: a `VarlenMask` holding the block lengths; attention runs once per sequence with
  ``is_causal=True`` SDPA, so compute is ``sum(len_i^2)`` instead of ``L^2``.

Shared-prompt packs (``[P R1 R2 ... RG]``, see `grpo.packing`) add one rule to the block-causal
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


# What a config may ask for: a concrete form, or "auto" for the fastest one on the device.


def resolve_mask_kind(mask_kind: str, device: torch.device | str) -> str:
    """The mask form to pack with: ``"auto"`` becomes the fastest form on ``device``.

    ``"auto"`` is ``"flex"`` on CUDA (block-sparse kernel, O(L) memory) and ``"varlen"``
    elsewhere: on CPU a dense ``[L, L]`` mask makes SDPA compute every cross-sequence block,
    about twice the step time of varlen for a pack of 64 short sequences, and FlexAttention has
    no backward there.

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


# The block lengths differ in every pack: traced by dynamo they would be baked into the graph
# and recompile it for each pack. A compiled layer (training.compile) breaks its graph here.
@torch.compiler.disable(recursive=False)
def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, dropout_p: float
) -> torch.Tensor:
    """Causal SDPA on each block separately; a Python loop over blocks, not tokens.

    A block with a prefix block (a response after its shared prompt) runs SDPA with its own
    rows as queries and the prefix's rows then its own as keys, under a bottom-right-aligned
    causal mask: query ``i`` sees the whole prefix and its own keys ``0..i``, exactly the keys
    it has when the prompt and the response run alone as one sequence.
    """
    seq_len = q.shape[2]
    if seq_len != mask.seq_len or k.shape[2] != mask.seq_len:
        raise ValueError(
            f"VarlenMask covers {mask.seq_len} tokens but queries have {seq_len} and keys "
            f"{k.shape[2]}; pass the mask built for this pack"
        )
    lens = list(mask.block_lens)
    prefixes = mask.prefix_blocks or (-1,) * len(lens)
    q_blocks, k_blocks, v_blocks = q.split(lens, 2), k.split(lens, 2), v.split(lens, 2)
    # One bool mask per (block, prefix) shape, shared by the blocks of that shape; built here,
    # in each layer, because it is tiny next to the attention it masks. (SDPA's is_causal
    # aligns the diagonal top-left when queries and keys differ in number, hence the mask.)
    prefix_masks: dict[tuple[int, int], torch.Tensor] = {}
    outputs = []
    for q_block, k_block, v_block, prefix in zip(q_blocks, k_blocks, v_blocks, prefixes):
        if prefix < 0:
            out = F.scaled_dot_product_attention(
                q_block, k_block, v_block, dropout_p=dropout_p, is_causal=True
            )
        else:
            length, prefix_len = q_block.shape[2], lens[prefix]
            attn_mask = prefix_masks.get((length, prefix_len))
            if attn_mask is None:
                attn_mask = torch.ones(
                    length, prefix_len + length, dtype=torch.bool, device=q.device
                ).tril(prefix_len)
                prefix_masks[length, prefix_len] = attn_mask
            out = F.scaled_dot_product_attention(
                q_block,
                torch.cat([k_blocks[prefix], k_block], dim=2),
                torch.cat([v_blocks[prefix], v_block], dim=2),
                attn_mask=attn_mask,
                dropout_p=dropout_p,
            )
        # CPU SDPA returns [b, h, s, d] views of [b, s, h, d] memory: concatenating in that
        # layout is a contiguous copy, and torchtune's following `transpose(1, 2).contiguous()`
        # is free.
        outputs.append(out.transpose(1, 2))
    return torch.cat(outputs, dim=1).transpose(1, 2)


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
