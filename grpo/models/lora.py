"""Low-rank adapters on a torchtune decoder, and their exchange format (PEFT).

The adapters are torchtune's ``LoRALinear`` modules, not PEFT's wrappers (PEFT wraps
transformers models); FSDP2 shards them as plain layers, and ``disable_adapter(model)`` gives the
KL term's reference model. The PEFT layout is only the exchange format (vLLM, ``grpo export``).
"""

from __future__ import annotations

import grpo.models.torchao_compat  # noqa: F401  (first: torchtune.training needs it)

# isort: split

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune.modules.peft import LoRALinear
from torchtune.training import set_default_dtype

from grpo.choices import LORA_HF_MODULES
from grpo.config import LoRAConfig
from grpo.models.families import family_of
from grpo.models.save import atomic_folder

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "LORA_MODULES",
    "adapter_state_dict",
    "apply_lora",
    "base_state_dict",
    "is_adapter_key",
    "load_peft_adapter",
    "lora_modules",
    "merge_lora",
    "merge_peft_adapter",
    "peft_adapter_config",
    "peft_adapter_state_dict",
    "reset_lora_parameters",
    "save_peft_adapter",
    "trainable_parameters",
    "tune_adapter_state_dict",
]

# HF target name -> attribute path inside a torchtune decoder layer, the same in every family.
LORA_MODULES: dict[str, str] = {
    "q_proj": "attn.q_proj",
    "k_proj": "attn.k_proj",
    "v_proj": "attn.v_proj",
    "o_proj": "attn.output_proj",
    "gate_proj": "mlp.w1",
    "up_proj": "mlp.w3",
    "down_proj": "mlp.w2",
}

# HF target name -> module path inside an HF decoder layer (``model.layers.{i}.<path>``).
_HF_MODULES = LORA_HF_MODULES
_TARGET_OF_TUNE_PATH = {path: target for target, path in LORA_MODULES.items()}
_TARGET_OF_HF_PATH = {path: target for target, path in _HF_MODULES.items()}

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."

_ADAPTER_KEY = re.compile(r"(^|\.)lora_[ab]\.weight$")
_TUNE_ADAPTER_KEY = re.compile(r"^layers\.(\d+)\.(.+)\.lora_([ab])\.weight$")
_PEFT_ADAPTER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def lora_modules(decoder: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The ``(name, module)`` of every ``LoRALinear`` of a model, in module order."""
    return [(name, m) for name, m in decoder.named_modules() if isinstance(m, LoRALinear)]


def apply_lora(decoder: nn.Module, config: LoRAConfig) -> None:
    """Wrap the targeted linear layers of every decoder layer in LoRA adapters, in place.

    Each targeted ``nn.Linear`` becomes a ``LoRALinear`` on the base layer's own Parameters, so
    base keys keep their names. Every other parameter is frozen. Adapters are drawn from the
    current torch RNG in module order, so one seed gives one adapter on every rank; on device
    ``meta`` nothing is drawn: call `reset_lora_parameters` once the model is materialised.

    Raises:
        ValueError: If a target is not an ``nn.Linear`` in some layer (the model has no such
            layer, or it already carries an adapter); the model is then left unchanged.
    """
    targets = [target for target in LORA_MODULES if target in config.target_modules]
    wrapped = []
    for index, layer in enumerate(decoder.layers):
        for target in targets:
            parent_path, _, attr = LORA_MODULES[target].rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, attr, None)
            if type(base) is not nn.Linear:  # a LoRALinear is no nn.Linear subclass either
                raise ValueError(
                    f"training.lora.target_modules: {target!r} is layers.{index}."
                    f"{LORA_MODULES[target]}, a {type(base).__name__}, not an nn.Linear"
                )
            wrapped.append((parent, attr, base))
    for param in decoder.parameters():
        param.requires_grad_(False)
    for parent, attr, base in wrapped:
        setattr(parent, attr, _lora_linear(base, config))
    reset_lora_parameters(decoder)


def _lora_linear(base: nn.Linear, config: LoRAConfig) -> LoRALinear:
    """A ``LoRALinear`` around ``base``'s own Parameters; its adapter is left uninitialised."""
    weight = base.weight
    # Built on meta so that its own base weight (replaced below) is never allocated.
    with set_default_dtype(weight.dtype), torch.device("meta"):
        lora = LoRALinear(
            in_dim=base.in_features,
            out_dim=base.out_features,
            rank=config.rank,
            alpha=config.alpha,
            dropout=config.dropout,
            use_bias=base.bias is not None,
        )
    lora.weight = weight
    lora.bias = base.bias
    lora.to_empty(device=weight.device)  # LoRALinear's to_empty: lora_a and lora_b only
    lora.lora_a.weight.requires_grad_(True)
    lora.lora_b.weight.requires_grad_(True)
    return lora


def reset_lora_parameters(decoder: nn.Module) -> None:
    """Initialise every adapter of a model again (``lora_a`` kaiming-uniform, ``lora_b`` zeros),
    from the current torch RNG in module order (on ``meta``: nothing)."""
    for _, module in lora_modules(decoder):
        module.initialize_parameters()


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key is an adapter weight (``...lora_a.weight``, ``...lora_b.weight``)."""
    return _ADAPTER_KEY.search(name) is not None


def adapter_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries of a state dict (the tensors themselves, not copies)."""
    return {name: tensor for name, tensor in state.items() if is_adapter_key(name)}


def base_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict without its adapter entries: the keys of the plain model."""
    return {name: tensor for name, tensor in state.items() if not is_adapter_key(name)}


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad (after `apply_lora`, the adapters'), in module order."""
    return [param for param in module.parameters() if param.requires_grad]


def _llama_row_permutation(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``target -> (heads, head_dim)`` of the projections whose rows HF stores permuted (Llama's
    q/k); ``lora_B``'s rows are output rows of the projection, so they take the same order."""
    if family_of(hf_config).model_type != "llama":
        return {}
    num_heads = int(hf_config["num_attention_heads"])
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    head_dim = int(hf_config["hidden_size"]) // num_heads
    return {"q_proj": (num_heads, head_dim), "k_proj": (num_kv_heads, head_dim)}


def _permute_rows(t: torch.Tensor, heads: int, head_dim: int, *, to_hf: bool) -> torch.Tensor:
    # torchtune's convert_weights permutation (tune_to_hf / hf_to_tune), for any column count.
    split = (heads, head_dim // 2, 2, -1) if to_hf else (heads, 2, head_dim // 2, -1)
    return t.reshape(split).transpose(1, 2).reshape(heads * head_dim, -1)


def peft_adapter_state_dict(
    tune_adapter: Mapping[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's names, as PEFT saves them and vLLM loads them.

    ``layers.3.attn.q_proj.lora_a.weight`` becomes
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. Tensors must be full
    (gather FSDP shards first).

    Raises:
        ValueError: If a name is not an adapter of a `LORA_MODULES` layer, or the model type
            is not supported.
    """
    permuted = _llama_row_permutation(hf_config)
    converted = {}
    for name, tensor in tune_adapter.items():
        match = _TUNE_ADAPTER_KEY.match(name)
        target = match and _TARGET_OF_TUNE_PATH.get(match.group(2))
        if not target:
            raise ValueError(f"{name!r} is not a LoRA adapter weight of a decoder layer")
        layer, matrix = match.group(1), match.group(3)
        if matrix == "b" and target in permuted:
            tensor = _permute_rows(tensor, *permuted[target], to_hf=True)
        hf_name = f"model.layers.{layer}.{_HF_MODULES[target]}.lora_{matrix.upper()}.weight"
        converted[_PEFT_PREFIX + hf_name] = tensor
    return converted


def tune_adapter_state_dict(
    peft_tensors: Mapping[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The inverse of `peft_adapter_state_dict`: PEFT names to torchtune adapter keys.

    Returns:
        dict[str, torch.Tensor]: torchtune adapter key -> tensor, loadable with
        ``load_state_dict(..., strict=False)`` into a model wrapped with the same targets.

    Raises:
        ValueError: If a tensor is not a LoRA A/B weight of a targetable layer (an adapter
            on embeddings or ``lm_head``, a DoRA magnitude, a bias).
    """
    permuted = _llama_row_permutation(hf_config)
    converted = {}
    for name, tensor in peft_tensors.items():
        match = _PEFT_ADAPTER_KEY.match(name.removeprefix(_PEFT_PREFIX))
        target = match and _TARGET_OF_HF_PATH.get(match.group(2))
        if not target:
            raise ValueError(
                f"adapter tensor {name!r} is not a LoRA A/B weight of one of "
                f"{', '.join(_HF_MODULES)}"
            )
        layer, matrix = match.group(1), match.group(3).lower()
        if matrix == "b" and target in permuted:
            tensor = _permute_rows(tensor, *permuted[target], to_hf=False)
        converted[f"layers.{layer}.{LORA_MODULES[target]}.lora_{matrix}.weight"] = tensor
    return converted


def peft_adapter_config(config: LoRAConfig, base_model_path: str | os.PathLike) -> dict[str, Any]:
    """The ``adapter_config.json`` of an adapter, with the keys PEFT writes for a LoRA.

    An existing ``base_model_path`` folder is made absolute, so ``grpo export`` finds the base
    from any directory.
    """
    base = os.path.abspath(base_model_path) if os.path.isdir(base_model_path) else base_model_path
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        # Sorted as PEFT does (it stores a set), so equal configs give equal files.
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_peft_adapter(
    out_dir: str | os.PathLike,
    peft_tensors: Mapping[str, torch.Tensor],
    adapter_config: dict[str, Any],
) -> Path:
    """Write a PEFT adapter folder (``adapter_model.safetensors`` + config) at ``out_dir``; an
    existing one is replaced only once the new folder is complete."""
    out_dir = Path(out_dir)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in peft_tensors.items()}
    with atomic_folder(out_dir) as (tmp_dir, written):
        weights_path = tmp_dir / ADAPTER_WEIGHTS_FILE
        save_file(tensors, str(weights_path), metadata={"format": "pt"})
        config_path = tmp_dir / ADAPTER_CONFIG_FILE
        config_path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        written += [weights_path, config_path]
    return out_dir


def load_peft_adapter(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT adapter folder: its tensors (PEFT names, on CPU) and its parsed config.

    Raises:
        FileNotFoundError: If the folder or one of the two files is missing, naming it.
    """
    folder = Path(folder)
    for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{str(folder)!r} is not a PEFT adapter folder (no {name})")
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    return load_file(str(folder / ADAPTER_WEIGHTS_FILE)), config


def merge_lora(
    tune_state: Mapping[str, torch.Tensor], config: LoRAConfig
) -> dict[str, torch.Tensor]:
    """Fold the adapters into their base weights: the state dict a plain model loads.

    Each adapted weight becomes ``W + (alpha / rank) * B @ A`` (computed in float32, stored in
    ``W``'s dtype); the input is not modified.

    Raises:
        ValueError: If an adapter has no base weight or lacks its A or B half.
    """
    scale = config.alpha / config.rank
    merged = base_state_dict(tune_state)
    prefixes = {name.rsplit(".", 2)[0] for name in adapter_state_dict(tune_state)}
    for prefix in sorted(prefixes):
        names = (f"{prefix}.weight", f"{prefix}.lora_a.weight", f"{prefix}.lora_b.weight")
        missing = [name for name in names if name not in tune_state]
        if missing:
            raise ValueError(f"cannot merge the adapter of {prefix!r}: no {', '.join(missing)}")
        weight, lora_a, lora_b = (tune_state[name] for name in names)
        delta = scale * (lora_b.float() @ lora_a.float())
        merged[names[0]] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged


def merge_peft_adapter(
    base: Mapping[str, torch.Tensor], peft_tensors: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Fold a PEFT adapter into Hugging Face weights: the state dict vLLM loads without LoRA.

    `merge_lora` under HF names: each adapted ``W`` becomes ``W + scale * B @ A`` (computed in
    float32, stored in ``W``'s dtype); every other tensor is ``base``'s own (not copied), and
    neither input is modified. PEFT's ``B`` rows are already in HF order (Llama's q/k too).

    Args:
        base: HF-named weights of the base model.
        peft_tensors: The adapter under PEFT names (`peft_adapter_state_dict`).
        scale: ``alpha / rank``.

    Raises:
        ValueError: If a tensor is not a LoRA A/B weight, an adapter lacks its A or B half, or
            the base has no weight for it.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in peft_tensors.items():
        match = _PEFT_ADAPTER_KEY.match(name.removeprefix(_PEFT_PREFIX))
        if not match or match.group(2) not in _TARGET_OF_HF_PATH:
            raise ValueError(f"adapter tensor {name!r} is not a LoRA A/B weight")
        prefix = f"model.layers.{match.group(1)}.{match.group(2)}"
        halves.setdefault(prefix, {})[match.group(3)] = tensor
    merged = dict(base)
    for prefix, pair in sorted(halves.items()):
        weight_name = f"{prefix}.weight"
        missing = [f"lora_{half}" for half in "AB" if half not in pair]
        if weight_name not in base:
            missing.append("base weight")
        if missing:
            raise ValueError(f"cannot merge the adapter of {prefix!r}: no {', '.join(missing)}")
        weight = base[weight_name]
        delta = scale * (pair["B"].float() @ pair["A"].float())
        merged[weight_name] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged
