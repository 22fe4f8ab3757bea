"""The supported model families, keyed by ``config.json``'s ``model_type``, and dispatch on it.

Each family module exposes a `ModelFamily`; the conversions here are family-independent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtune.models.qwen2 import qwen2 as _qwen2_builder
from torchtune.modules import TransformerDecoder

from grpo.models import llama, qwen2, qwen3

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelFamily:
    """How to build and convert one architecture.

    Args:
        builder_args (Callable): ``hf_config -> kwargs`` of ``builder``; raises ValueError
            for configs it cannot build.
        tune_to_hf_converter (Callable): ``hf_config -> ((tune_name, tensor) -> (hf_name,
            tensor))``; raises for a name it does not know.
    """

    model_type: str
    builder_args: Callable[[dict[str, Any]], dict[str, Any]]
    builder: Callable[..., TransformerDecoder]
    hf_to_tune_state_dict: Callable[[StateDict, dict[str, Any]], StateDict]
    tune_to_hf_converter: Callable[
        [dict[str, Any]], Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]
    ]


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily(
            "qwen2",
            qwen2.qwen2_builder_args,
            _qwen2_builder,
            qwen2.hf_to_tune_state_dict,
            qwen2.tune_to_hf_converter,
        ),
        ModelFamily(
            "qwen3",
            qwen3.qwen3_builder_args,
            qwen3.qwen3,
            qwen3.hf_to_tune_state_dict,
            qwen3.tune_to_hf_converter,
        ),
        ModelFamily(
            "llama",
            llama.llama_builder_args,
            llama.llama,
            llama.hf_to_tune_state_dict,
            llama.tune_to_hf_converter,
        ),
    )
}

# The ``model_type``s of ``config.json`` that `grpo.models.build_model` builds.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(hf_config: dict[str, Any], source: str | None = None) -> ModelFamily:
    """The family of a model config, from its ``model_type``.

    Raises:
        ValueError: If ``model_type`` is missing or not supported, naming it, the file
            (``source``) and the supported types.
    """
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        where = f" in {source!r}" if source else ""
        raise ValueError(
            f"model_type {model_type!r}{where} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return FAMILIES[model_type]


def hf_to_tune_state_dict(state_dict: StateDict, hf_config: dict[str, Any]) -> StateDict:
    """Convert an HF state dict to torchtune names, for the config's family.

    Tensors are not copied (Llama's q/k rows are permuted); ``lm_head.weight`` is dropped when
    the config ties embeddings.

    Raises:
        ValueError: If the model type is not supported or a key has no torchtune counterpart.
    """
    return family_of(hf_config).hf_to_tune_state_dict(state_dict, hf_config)


def hf_weight_iterator(
    tune_state_dict: StateDict | Iterable[tuple[str, torch.Tensor]], hf_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of a torchtune state dict, lazily.

    The one torchtune -> HF conversion (saving and weight sync both use it), one tensor at a
    time so that streaming a large model builds no second dict. With tied embeddings no
    ``lm_head.weight`` is yielded. Tensors must be full (gather FSDP shards first).

    Raises:
        ValueError: If the model type is not supported or a name has no HF counterpart.
    """
    # The family and its config are checked now, at the call; the weights convert lazily.
    family = family_of(hf_config)
    tied = family.builder_args(hf_config)["tie_word_embeddings"]
    convert = family.tune_to_hf_converter(hf_config)
    items = tune_state_dict.items() if isinstance(tune_state_dict, dict) else tune_state_dict

    def converted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            if tied and name == "output.weight":
                continue
            try:
                hf_name, hf_tensor = convert(name, tensor)
            except Exception as err:  # torchtune raises a bare Exception naming the key
                raise ValueError(
                    f"torchtune weight {name!r} has no Hugging Face {family.model_type} name"
                ) from err
            yield hf_name, hf_tensor

    return converted()


def tune_to_hf_state_dict(state_dict: StateDict, hf_config: dict[str, Any]) -> StateDict:
    """Convert a torchtune state dict to HF names, for the config's family.

    No ``lm_head.weight`` when embeddings are tied.

    Raises:
        ValueError: If the model type is not supported or a name has no HF counterpart.
    """
    return dict(hf_weight_iterator(state_dict, hf_config))
