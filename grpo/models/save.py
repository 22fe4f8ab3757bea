"""Save a torchtune state dict as a Hugging Face model folder, atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from grpo.models.families import hf_weight_iterator
from grpo.models.hf_folder import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
    WEIGHT_FILE_SUFFIXES,
    hf_weight_names,
    load_hf_config,
    model_folder,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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

    POSIX has no atomic swap of two non-empty folders: the old one is renamed aside first (and
    put back if the second rename fails; after a crash it survives as ``.<name>.old-<id>``).
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


@contextlib.contextmanager
def atomic_folder(out_dir: Path) -> Iterator[tuple[Path, list[Path]]]:
    """Write a folder atomically: yields a temporary sibling of ``out_dir`` and a list the
    caller appends each file it writes there to.

    On a clean exit the files are fsynced before the rename publishes the folder (a crash never
    leaves a complete-looking folder with truncated files); on an error nothing changes.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    written: list[Path] = []
    try:
        yield tmp_dir, written
        for path in written:
            _fsync_path(path)
        tmp_dir.chmod(0o755)  # mkdtemp creates 0o700
        _fsync_path(tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def save_hf_checkpoint(
    tune_state_dict: dict[str, torch.Tensor],
    model_dir_src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a torchtune state dict (any supported family) as a Hugging Face checkpoint folder, atomically.

    The folder gets the source's ``config.json`` (``torch_dtype`` set to the saved dtype), the
    weights under HF names and a copy of every other top-level file of the source folder. An
    existing ``out_dir`` is replaced only once the new folder is complete.

    Args:
        tune_state_dict (dict[str, torch.Tensor]): Full (not FSDP-sharded) torchtune state
            dict; tensors may be on any device.
        model_dir_src (str | os.PathLike): Folder of the model the state dict belongs to.
        max_shard_bytes (int | None): Split the weights into ``model-0000i-of-0000n``
            safetensors files of at most this size with an index; default one file.

    Raises:
        FileNotFoundError: If the source folder, its config or weights are missing.
        ValueError: If the state dict's tensor names (after renaming) differ from those of the
            source checkpoint.
    """
    model_dir_src = model_folder(model_dir_src)
    out_dir = Path(out_dir)
    hf_config = load_hf_config(model_dir_src)
    hf_state_dict = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in hf_weight_iterator(tune_state_dict, hf_config)
    }
    # Compare with the source checkpoint's names so that a partial state dict fails here, not
    # when vLLM or a later run loads the folder.
    expected = {n for n in hf_weight_names(model_dir_src) if "rotary_emb.inv_freq" not in n}
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

    with atomic_folder(out_dir) as (tmp_dir, written):
        written += _write_weights(hf_state_dict, tmp_dir, max_shard_bytes)
        config_path = tmp_dir / "config.json"
        config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        written.append(config_path)
        for src in sorted(model_dir_src.iterdir()):
            if src.is_file() and src.name != "config.json":
                if not src.name.endswith(WEIGHT_FILE_SUFFIXES):
                    written.append(Path(shutil.copy2(src, tmp_dir / src.name)))
    return out_dir
