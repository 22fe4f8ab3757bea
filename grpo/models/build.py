"""Build a torchtune model from a Hugging Face model folder, in the dtype a config names."""

from __future__ import annotations

import grpo.models.torchao_compat  # noqa: F401  (first: torchtune.training needs it)

# isort: split

import os

import torch
from torchtune.modules import TransformerDecoder
from torchtune.training import set_default_dtype

from grpo.models.families import SUPPORTED_MODEL_TYPES, family_of
from grpo.models.hf_folder import load_hf_config, load_hf_state_dict, model_folder

__all__ = ["DTYPES", "SUPPORTED_MODEL_TYPES", "build_model", "torch_dtype"]

# Config spellings of the parameter dtypes the actors take (ref.dtype, training.dtype).
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``fp32``, ``bf16``, ``float32``, ``bfloat16``).

    Raises:
        ValueError: For any other name, listing the accepted ones.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def build_model(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_weights: bool = True,
    max_seq_len: int | None = None,
    packed_len: int | None = None,
) -> TransformerDecoder:
    """Build a torchtune ``TransformerDecoder`` from a Hugging Face model folder; the family and
    every size come from its ``config.json``.

    Args:
        device (str | torch.device): ``"meta"`` needs ``load_weights=False`` (for FSDP, which
            materialises and loads later).
        max_seq_len (int | None): Longest sequence the model will see (sizes the RoPE cache);
            defaults to ``max_position_embeddings``.
        packed_len (int | None): Longest packed input (several sequences in one row, each
            with positions from 0), accepted even when longer than ``max_seq_len``.

    Raises:
        FileNotFoundError: If the folder, config or weights are missing.
        ValueError: If the config's ``model_type`` is not supported, it uses a feature its
            family does not implement, or ``device="meta"`` comes with ``load_weights=True``.
        RuntimeError: If the checkpoint's tensors do not match the model.
    """
    model_dir = model_folder(model_dir)
    hf_config = load_hf_config(model_dir)
    family = family_of(hf_config, source=str(model_dir / "config.json"))
    builder_args = family.builder_args(hf_config)
    if max_seq_len is not None:
        builder_args["max_seq_len"] = max_seq_len
    if packed_len is not None:
        # torchtune refuses inputs longer than max_seq_len; positions restart in every packed
        # sequence, so a longer RoPE cache changes nothing but that check.
        builder_args["max_seq_len"] = max(int(builder_args["max_seq_len"]), int(packed_len))
    if torch.device(device).type == "meta" and load_weights:
        raise ValueError("device='meta' builds an empty model; pass load_weights=False")
    with set_default_dtype(dtype), torch.device(device):
        model = family.builder(**builder_args)
    if load_weights:
        state_dict = family.hf_to_tune_state_dict(load_hf_state_dict(model_dir), hf_config)
        # strict: a renamed or missing tensor must fail here, not train silently from init.
        model.load_state_dict(state_dict, strict=True)
    return model
