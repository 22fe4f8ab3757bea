"""Qwen3 (dense) through torchtune modules: architecture from ``config.json``, weight names.

Qwen3 is Qwen2 without q/k/v biases, with an RMSNorm over each query and key head and an
explicit ``head_dim``. torchtune 0.6.1 has no Qwen3 builder, and its ``MultiHeadAttention``
applies q/k norms after RoPE where HF applies them before (the norm's scale does not commute
with the rotation), hence `Qwen3Attention`. Weight conversion is a renaming, like Qwen2's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.qwen2._component_builders import qwen2_mlp
from torchtune.models.qwen2._convert_weights import _FROM_HF as _QWEN2_FROM_HF
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

from grpo.models.hf_config import required_key, rope_scaling, rope_theta

# HF -> torchtune names: Qwen2's without the q/k/v biases, plus the per-head q/k norms.
_FROM_HF = {
    **{hf: tune for hf, tune in _QWEN2_FROM_HF.items() if not hf.endswith(".bias")},
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
}
_TO_HF = {tune: hf for hf, tune in _FROM_HF.items() if tune is not None}


class Qwen3Attention(MultiHeadAttention):
    """torchtune's ``MultiHeadAttention`` with ``q_norm``/``k_norm`` applied per head before RoPE,
    as in HF; ``q_norm``, ``k_norm`` and ``pos_embeddings`` are required."""

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: Any = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of ``x`` (``y`` is ``x``, or None to read the KV cache).

        Arguments and result as torchtune's ``MultiHeadAttention.forward``; ``mask`` may also be
        a `grpo.packing.attention.VarlenMask`.

        Raises:
            ValueError: If ``y`` is None without an enabled KV cache.
        """
        b, s_x, _ = x.shape
        # [b, s, n_h, h_d]: the norm acts on the last (head) dim, before the rotation.
        q = self.q_norm(self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim))
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError(
                    "Must provide y input or use kv_cache to enable streaming decoding"
                )
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            s_y = y.shape[1]
            k = self.k_norm(self.k_proj(y).view(b, s_y, -1, self.head_dim))
            k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
            v = self.v_proj(y).view(b, s_y, -1, self.head_dim).transpose(1, 2)
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:  # grouped-query attention: share each kv head
            q_per_kv = self.num_heads // self.num_kv_heads
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    head_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A Qwen3 dense decoder from torchtune modules (`Qwen3Attention`, Qwen2 RoPE and MLP).

    Args:
        head_dim (int): Size of one head (not necessarily ``embed_dim // num_heads``).
        norm_eps (float): Epsilon of every RMSNorm, the q/k norms included.
    """
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = Qwen3Attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim),
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        output = TiedLinear(tok_embeddings)
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def qwen3_builder_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of `qwen3`, read from an HF Qwen3 (dense) config.

    Raises:
        ValueError: If the config is not a Qwen3 config, lacks a key, or uses a feature not
            implemented here (attention biases, RoPE scaling, sliding-window attention,
            ``num_key_value_heads`` not dividing ``num_attention_heads``).
    """
    model_type = hf_config.get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"model_type must be 'qwen3' (Qwen3 dense), got {model_type!r}")
    embed_dim = int(required_key(hf_config, "hidden_size", "Qwen3"))
    num_heads = int(required_key(hf_config, "num_attention_heads", "Qwen3"))
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})"
        )
    if hf_config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for qwen3 (Qwen3 has no biases)")
    if (scaling := rope_scaling(hf_config)) is not None:
        raise ValueError(f"RoPE scaling (rope_scaling={scaling!r}) is not supported for qwen3")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported for qwen3")
    return {
        "vocab_size": int(required_key(hf_config, "vocab_size", "Qwen3")),
        "num_layers": int(required_key(hf_config, "num_hidden_layers", "Qwen3")),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": embed_dim,
        # Qwen3Config's default when absent, as in transformers.
        "head_dim": int(hf_config.get("head_dim") or embed_dim // num_heads),
        "intermediate_dim": int(required_key(hf_config, "intermediate_size", "Qwen3")),
        "max_seq_len": int(required_key(hf_config, "max_position_embeddings", "Qwen3")),
        "rope_base": rope_theta(hf_config, default=10_000.0),
        "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
        # Qwen3-0.6B/1.7B/4B set it to true, 8B and larger to false.
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
    }


def _tied(hf_config: dict[str, Any]) -> bool:
    return qwen3_builder_args(hf_config)["tie_word_embeddings"]


def hf_to_tune_state_dict(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename an HF Qwen3 state dict to torchtune names (tensors are not copied); a tied
    ``lm_head.weight`` and old checkpoints' rotary ``inv_freq`` buffers are dropped.

    Raises:
        ValueError: If a key has no torchtune counterpart, or the config is not Qwen3.
    """
    tied = _tied(hf_config)
    converted = {}
    for name, tensor in state_dict.items():
        if (tied and name == "lm_head.weight") or "rotary_emb.inv_freq" in name:
            continue
        try:
            converted[get_mapped_key(name, _FROM_HF)] = tensor
        except Exception as err:  # torchtune raises a bare Exception naming the key
            raise ValueError(f"HF Qwen3 weight {name!r} has no torchtune name") from err
    return converted


def tune_to_hf_converter(
    hf_config: dict[str, Any],
) -> Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """The torchtune -> HF conversion of one Qwen3 weight: ``(tune_name, tensor) -> (hf_name,
    tensor)``, a renaming that raises for an unknown name."""
    return lambda name, tensor: (get_mapped_key(name, _TO_HF), tensor)
