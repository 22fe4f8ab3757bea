"""Qwen2 models, tokenizers and checkpoints in Hugging Face layout, through torchtune.

A model folder is a Hugging Face checkpoint: ``config.json``, ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``), ``vocab.json``, ``merges.txt`` and usually
``tokenizer.json``. Everything about the architecture is read from ``config.json``, so the
same code serves the tiny test model and Qwen2/Qwen2.5 checkpoints of any size.

Weight names: torchtune and vLLM/HF name the same Qwen2 tensors differently
(``layers.0.attn.q_proj.weight`` vs ``model.layers.0.self_attn.q_proj.weight``). Qwen2 needs
no permutation of q/k (torchtune's Qwen2 RoPE uses the HF rotate-half layout), so conversion
is a renaming done by torchtune's ``qwen2_hf_to_tune`` / ``qwen2_tune_to_hf``, plus the tied
embedding rule: with ``tie_word_embeddings`` the HF checkpoint stores no ``lm_head.weight`` and
the torchtune model has no ``output.weight`` (its output is a ``TiedLinear`` on the embedding).
`hf_weight_iterator` is the single tune->HF path, used by `save_hf_checkpoint` and by weight
sync to vLLM (``reload_weights(weights_iterator=...)``).

Hidden states and the output projection for the chunked loss live in `grpo.logprobs`
(`model_hidden_states`, `output_projection_weight`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torchao.quantization
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _patch_torchao_for_torchtune() -> None:
    """Let ``torchtune.training`` import with torchao 0.16.

    torchtune 0.6.1's ``torchtune.training.quantization`` imports ``int4_weight_only`` and
    ``int8_dynamic_activation_int4_weight`` from ``torchao.quantization``. torchao 0.16 removed
    these names, which were aliases of the config classes below, so without them every import
    of ``torchtune.training`` (checkpointers, ``set_default_dtype``, FSDP helpers) fails.
    """
    aliases = {
        "int4_weight_only": "Int4WeightOnlyConfig",
        "int8_dynamic_activation_int4_weight": "Int8DynamicActivationInt4WeightConfig",
    }
    for old_name, config_name in aliases.items():
        if not hasattr(torchao.quantization, old_name):
            setattr(torchao.quantization, old_name, getattr(torchao.quantization, config_name))


_patch_torchao_for_torchtune()

from torchtune.models.qwen2 import qwen2, qwen2_tokenizer  # noqa: E402
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf  # noqa: E402
from torchtune.models.qwen2._tokenizer import (  # noqa: E402
    ENDOFTEXT,
    IM_END,
    IM_START,
    Qwen2Tokenizer,
)
from torchtune.modules import TransformerDecoder  # noqa: E402
from torchtune.training import set_default_dtype  # noqa: E402

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Files of a model folder that are weights: never copied by `save_hf_checkpoint`, which writes
# its own. Everything else at the top level (tokenizer, generation config, README) is copied.
_WEIGHT_FILE_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Config spellings of the parameter dtypes the actors take (ref.dtype, training.dtype).
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``fp32``, ``bf16``, ``float32``, ``bfloat16``).

    Args:
        name (str): A key of `DTYPES`.

    Returns:
        torch.dtype: The dtype.

    Raises:
        ValueError: For any other name, listing the accepted ones.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def _model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist or is not a folder")
    return path


def _required_file(model_dir: Path, name: str, what: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} not found (model folder {str(model_dir)!r})")
    return path


def load_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` of a Hugging Face model folder.

    Args:
        model_dir (str | os.PathLike): Model folder.

    Returns:
        dict[str, Any]: The parsed config.

    Raises:
        FileNotFoundError: If the folder or its ``config.json`` does not exist.
        ValueError: If ``config.json`` is not a JSON object.

    Example:
        >>> load_hf_config("/path/to/Qwen2.5-0.5B")["model_type"]
        'qwen2'
    """
    path = _required_file(_model_dir(model_dir), "config.json", "model config")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object")
    return config


def _config_value(hf_config: dict[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"model config has no {key!r}; a Qwen2 config.json needs it")
    return hf_config[key]


def _rope_theta(hf_config: dict[str, Any]) -> float:
    # transformers < 5 writes a top-level `rope_theta`; transformers 5 nests it in
    # `rope_parameters`. 10000.0 is Qwen2Config's default when neither is present.
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    rope_parameters = hf_config.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", 10_000.0))


def qwen2_builder_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of torchtune's ``qwen2`` component builder, read from an HF Qwen2 config.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, Any]: ``vocab_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
        ``embed_dim``, ``intermediate_dim``, ``max_seq_len``, ``rope_base``, ``norm_eps`` and
        ``tie_word_embeddings``.

    Raises:
        ValueError: If the config is not a Qwen2 config, lacks a key, or uses a feature
            torchtune's Qwen2 does not implement (RoPE scaling, sliding-window attention, a head
            dim other than ``hidden_size // num_attention_heads``).
    """
    model_type = hf_config.get("model_type")
    if model_type != "qwen2":
        raise ValueError(f"model_type must be 'qwen2' (Qwen2/Qwen2.5), got {model_type!r}")
    embed_dim = int(_config_value(hf_config, "hidden_size"))
    num_heads = int(_config_value(hf_config, "num_attention_heads"))
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * num_heads != embed_dim:
        raise ValueError(
            f"head_dim ({head_dim}) * num_attention_heads ({num_heads}) != hidden_size "
            f"({embed_dim}); torchtune's qwen2 derives head_dim as hidden_size // num_heads"
        )
    rope_parameters = hf_config.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if hf_config.get("rope_scaling") or rope_type != "default":
        raise ValueError(
            f"RoPE scaling (rope_scaling={hf_config.get('rope_scaling')!r}, "
            f"rope_type={rope_type!r}) is not supported by torchtune's qwen2"
        )
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported by torchtune's qwen2")
    return {
        "vocab_size": int(_config_value(hf_config, "vocab_size")),
        "num_layers": int(_config_value(hf_config, "num_hidden_layers")),
        "num_heads": num_heads,
        "num_kv_heads": int(hf_config.get("num_key_value_heads") or num_heads),
        "embed_dim": embed_dim,
        "intermediate_dim": int(_config_value(hf_config, "intermediate_size")),
        "max_seq_len": int(_config_value(hf_config, "max_position_embeddings")),
        "rope_base": _rope_theta(hf_config),
        "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
        # Qwen2Config's default is False; Qwen2.5 0.5B-3B set it to true, 7B+ to false.
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
    }


def _conversion_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    args = qwen2_builder_args(hf_config)
    return {
        "num_heads": args["num_heads"],
        "num_kv_heads": args["num_kv_heads"],
        "dim": args["embed_dim"],
        "tie_word_embeddings": args["tie_word_embeddings"],
    }


def hf_to_tune_state_dict(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename an HF Qwen2 state dict to torchtune names (tensors are not copied).

    ``lm_head.weight`` is dropped when the config ties embeddings, and rotary ``inv_freq``
    buffers of old checkpoints are dropped.

    Args:
        state_dict (dict[str, torch.Tensor]): Full HF state dict (all shards merged).
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, torch.Tensor]: State dict for torchtune's ``qwen2`` model.

    Raises:
        ValueError: If a key has no torchtune counterpart, or the config is not Qwen2.
    """
    args = _conversion_args(hf_config)
    try:
        return qwen2_hf_to_tune(state_dict, **args)
    except Exception as err:  # torchtune raises a bare Exception naming the unknown key
        raise ValueError(f"cannot convert HF Qwen2 state dict to torchtune: {err}") from err


def hf_weight_iterator(
    tune_state_dict: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config: dict[str, Any],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of a torchtune Qwen2 state dict.

    This is the one torchtune->HF conversion: `save_hf_checkpoint` and weight sync to vLLM
    (``model_runner.reload_weights(weights_iterator=...)``) both use it. It renames lazily, one
    tensor at a time, so streaming a large model does not build a second dict. With tied
    embeddings no ``lm_head.weight`` is yielded (HF and vLLM take it from the embedding).
    Tensors must be full (gather FSDP ``DTensor`` shards before calling).

    Args:
        tune_state_dict (dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]): A
            torchtune Qwen2 ``state_dict()`` or ``(name, tensor)`` pairs.
        hf_config (dict[str, Any]): Parsed ``config.json`` of the model.

    Yields:
        tuple[str, torch.Tensor]: HF name and the same tensor object.

    Raises:
        ValueError: If a name has no HF counterpart.

    Example:
        >>> model = build_model(model_dir)
        >>> names = [name for name, _ in hf_weight_iterator(model.state_dict(), config)]
        >>> names[0]
        'model.embed_tokens.weight'
    """
    args = _conversion_args(hf_config)
    items = tune_state_dict.items() if isinstance(tune_state_dict, dict) else tune_state_dict
    for name, tensor in items:
        if args["tie_word_embeddings"] and name == "output.weight":
            continue
        try:
            ((hf_name, hf_tensor),) = qwen2_tune_to_hf({name: tensor}, **args).items()
        except Exception as err:
            raise ValueError(f"torchtune weight {name!r} has no Hugging Face Qwen2 name") from err
        yield hf_name, hf_tensor


def tune_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename a torchtune Qwen2 state dict to HF names (tensors are not copied).

    Args:
        state_dict (dict[str, torch.Tensor]): torchtune ``model.state_dict()``.
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, torch.Tensor]: HF state dict; no ``lm_head.weight`` when embeddings are tied.

    Raises:
        ValueError: If a name has no HF counterpart.
    """
    return dict(hf_weight_iterator(state_dict, hf_config))


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """Safetensors files of a model folder: the shards of the index, or the single file."""
    index_path = model_dir / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"checkpoint index {str(index_path)!r} has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(
                    f"shard {str(path)!r} listed in {str(index_path)!r} not found"
                )
        return files
    single = model_dir / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights in model folder {str(model_dir)!r}: expected {SAFETENSORS_FILE} or "
        f"{SAFETENSORS_INDEX_FILE}"
    )


def load_hf_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load all safetensors weights of a model folder under their HF names.

    Args:
        model_dir (str | os.PathLike): Model folder with ``model.safetensors`` or a sharded
            checkpoint with ``model.safetensors.index.json``.

    Returns:
        dict[str, torch.Tensor]: Merged CPU state dict.

    Raises:
        FileNotFoundError: If the folder, the weights or a listed shard is missing.
    """
    state_dict: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(_model_dir(model_dir)):
        state_dict.update(load_file(str(path)))
    return state_dict


def _hf_weight_names(model_dir: Path) -> set[str]:
    """Tensor names stored in a folder's safetensors files, read from the headers only."""
    names: set[str] = set()
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def build_model(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_weights: bool = True,
    max_seq_len: int | None = None,
) -> TransformerDecoder:
    """Build torchtune's Qwen2 ``TransformerDecoder`` from a Hugging Face model folder.

    Args:
        model_dir (str | os.PathLike): Model folder (``config.json`` + safetensors weights).
        dtype (torch.dtype): Parameter dtype.
        device (str | torch.device): Device to build on. ``"meta"`` needs
            ``load_weights=False`` (for FSDP, which materialises and loads later).
        load_weights (bool): Load the checkpoint's weights; otherwise keep torchtune's init.
        max_seq_len (int | None): Longest sequence the model will see (sizes the RoPE cache);
            defaults to ``max_position_embeddings``.

    Returns:
        TransformerDecoder: The model, in training mode.

    Raises:
        FileNotFoundError: If the folder, config or weights are missing.
        ValueError: If the config is not a supported Qwen2 config, or ``device="meta"`` is
            combined with ``load_weights=True``.
        RuntimeError: If the checkpoint's tensors do not match the model (missing or
            unexpected keys, wrong shapes).

    Example:
        >>> model = build_model("/path/to/Qwen2.5-0.5B", dtype=torch.bfloat16)
        >>> logits = model(torch.tensor([[1, 2, 3]]))  # [1, 3, vocab_size], float32
    """
    model_dir = _model_dir(model_dir)
    hf_config = load_hf_config(model_dir)
    builder_args = qwen2_builder_args(hf_config)
    if max_seq_len is not None:
        builder_args["max_seq_len"] = max_seq_len
    if torch.device(device).type == "meta" and load_weights:
        raise ValueError("device='meta' builds an empty model; pass load_weights=False")
    with set_default_dtype(dtype), torch.device(device):
        model = qwen2(**builder_args)
    if load_weights:
        state_dict = hf_to_tune_state_dict(load_hf_state_dict(model_dir), hf_config)
        # strict: a renamed or missing tensor must fail here, not train silently from init.
        model.load_state_dict(state_dict, strict=True)
    return model


def load_tokenizer(model_dir: str | os.PathLike, max_seq_len: int | None = None) -> Qwen2Tokenizer:
    """torchtune's Qwen2 tokenizer from ``vocab.json`` + ``merges.txt`` of a model folder.

    Special tokens and their ids come from ``tokenizer.json``'s ``added_tokens`` when the file
    exists (so a tiny model's small ids work), else torchtune's Qwen2 defaults (151643..).
    ``eos_id`` is ``<|im_end|>`` and ``pad_id`` is ``<|endoftext|>``; ``stop_tokens`` holds
    both. ``encode`` appends eos by default: pass ``add_eos=False`` for prompts.

    Args:
        model_dir (str | os.PathLike): Model folder.
        max_seq_len (int | None): Truncation length of ``tokenize_messages``.

    Returns:
        Qwen2Tokenizer: The tokenizer.

    Raises:
        FileNotFoundError: If the folder, ``vocab.json`` or ``merges.txt`` is missing.
        ValueError: If ``tokenizer.json`` lacks one of the Qwen2 special tokens.

    Example:
        >>> tokenizer = load_tokenizer(model_dir)
        >>> ids = tokenizer.encode("What is 2 + 3?", add_bos=False, add_eos=False)
    """
    model_dir = _model_dir(model_dir)
    vocab_path = _required_file(model_dir, "vocab.json", "tokenizer vocabulary")
    merges_path = _required_file(model_dir, "merges.txt", "tokenizer merges")
    tokenizer_json = model_dir / "tokenizer.json"
    special_tokens_path = None
    if tokenizer_json.is_file():
        added = json.loads(tokenizer_json.read_text()).get("added_tokens", [])
        missing = {ENDOFTEXT, IM_START, IM_END} - {token["content"] for token in added}
        if missing:
            raise ValueError(
                f"{str(tokenizer_json)!r} lacks the Qwen2 special tokens {sorted(missing)} "
                "in 'added_tokens'"
            )
        special_tokens_path = str(tokenizer_json)
    return qwen2_tokenizer(
        path=str(vocab_path),
        merges_file=str(merges_path),
        special_tokens_path=special_tokens_path,
        max_seq_len=max_seq_len,
    )


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard(
    state_dict: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Split a state dict, in order, into groups of at most `max_shard_bytes` (one if None)."""
    if max_shard_bytes is None:
        return [state_dict]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    return shards


def _write_weights(
    hf_state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None
) -> list[Path]:
    shards = _shard(hf_state_dict, max_shard_bytes)
    if len(shards) == 1:
        path = out_dir / SAFETENSORS_FILE
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        paths.append(out_dir / name)
    total_size = sum(t.numel() * t.element_size() for t in hf_state_dict.values())
    index_path = out_dir / SAFETENSORS_INDEX_FILE
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*paths, index_path]


def _replace_dir(new_dir: Path, out_dir: Path) -> None:
    """Move the complete `new_dir` to `out_dir`, replacing an existing `out_dir`.

    POSIX has no atomic swap of two non-empty folders, so the old folder is first renamed to a
    hidden sibling, then the new one takes its name, then the old one is deleted. If the second
    rename fails the old folder is put back. After a crash between the two renames the previous
    checkpoint survives as ``.<name>.old-<id>`` next to ``out_dir``.
    """
    if out_dir.exists():
        old_dir = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old_dir)
        try:
            os.rename(new_dir, out_dir)
        except BaseException:
            os.rename(old_dir, out_dir)
            raise
        shutil.rmtree(old_dir)
    else:
        os.rename(new_dir, out_dir)
    _fsync_path(out_dir.parent)


def save_hf_checkpoint(
    tune_state_dict: dict[str, torch.Tensor],
    model_dir_src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a torchtune Qwen2 state dict as a Hugging Face checkpoint folder, atomically.

    The folder gets ``config.json`` (the source's, with ``torch_dtype`` set to the saved
    dtype), the weights under HF names, and a copy of every other top-level file of the source
    folder (tokenizer files, ``generation_config.json``, ...). It is written to a temporary
    sibling, fsynced, then renamed to ``out_dir``; an existing ``out_dir`` is replaced only
    once the new folder is complete, and a failure leaves no partial folder behind. The result
    loads with `build_model`, `load_tokenizer` and vLLM.

    Args:
        tune_state_dict (dict[str, torch.Tensor]): Full (not FSDP-sharded) torchtune state
            dict, e.g. ``model.state_dict()``; tensors may be on any device.
        model_dir_src (str | os.PathLike): Folder of the model the state dict belongs to.
        out_dir (str | os.PathLike): Folder to write.
        max_shard_bytes (int | None): Split the weights into ``model-0000i-of-0000n``
            safetensors files of at most this size with an index; default one file.

    Returns:
        Path: ``out_dir``.

    Raises:
        FileNotFoundError: If the source folder, its config or weights are missing.
        ValueError: If the state dict's tensors (after renaming) differ from those stored in
            the source checkpoint (a missing or unexpected name).

    Example:
        >>> save_hf_checkpoint(model.state_dict(), "/models/Qwen2.5-0.5B", "/runs/x/step_100")
    """
    model_dir_src = _model_dir(model_dir_src)
    out_dir = Path(out_dir)
    hf_config = load_hf_config(model_dir_src)
    hf_state_dict = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in hf_weight_iterator(tune_state_dict, hf_config)
    }
    # Compare with the source checkpoint's names so that a partial state dict fails here, not
    # when vLLM or a later run loads the folder.
    expected = {n for n in _hf_weight_names(model_dir_src) if "rotary_emb.inv_freq" not in n}
    missing, unexpected = expected - hf_state_dict.keys(), hf_state_dict.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the checkpoint in {str(model_dir_src)!r}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    dtypes = {tensor.dtype for tensor in hf_state_dict.values() if tensor.is_floating_point()}
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in _DTYPE_NAMES:
        hf_config["torch_dtype"] = _DTYPE_NAMES[dtype]
        if "dtype" in hf_config:  # transformers 5 spelling
            hf_config["dtype"] = _DTYPE_NAMES[dtype]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        written = _write_weights(hf_state_dict, tmp_dir, max_shard_bytes)
        config_path = tmp_dir / "config.json"
        config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        written.append(config_path)
        for src in sorted(model_dir_src.iterdir()):
            if src.is_file() and src.name != "config.json":
                if not src.name.endswith(_WEIGHT_FILE_SUFFIXES):
                    written.append(Path(shutil.copy2(src, tmp_dir / src.name)))
        # Data on disk before the rename publishes the folder, so a crash never leaves a
        # complete-looking folder with truncated files.
        for path in written:
            _fsync_path(path)
        tmp_dir.chmod(0o755)  # mkdtemp creates 0o700
        _fsync_path(tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
