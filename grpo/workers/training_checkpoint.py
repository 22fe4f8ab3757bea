"""Sharded training state: model and optimizer saved and loaded per rank with DCP.

Every rank writes only its own shards of the trainable parameters (LoRA: the adapters) and
their optimizer state, so no rank holds the whole optimizer state; rank 0 adds the small
rank-independent rest as ``extra.pt``. A checkpoint saved by N workers loads into M. Atomicity
is the caller's, and with trainers on several nodes the folder must be on a shared filesystem.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger("grpo")

TRAINER_SUBDIR = "trainer"
"""The folder of a checkpoint that holds the trainers' sharded state."""

MODEL_SUBDIR = "model"
"""The folder of a checkpoint that holds the policy as a Hugging Face model (full fine-tuning)."""

ADAPTER_SUBDIR = "adapter"
"""The folder of a LoRA checkpoint that holds the adapter (PEFT), instead of `MODEL_SUBDIR`."""

EXTRA_STATE_FILE = "extra.pt"
METADATA_FILE = ".metadata"  # written by DCP's coordinator (rank 0) once every shard is written

# Frozen parameters (a LoRA model's base) are left out: a resume rebuilds them from the base model.
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True)
# Frozen parameters are "missing" from what was saved; `load_training_state` checks the rest.
_SHARDED_LOAD = StateDictOptions(
    full_state_dict=False, cpu_offload=False, ignore_frozen_params=True, strict=False
)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _dcp_call(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``dcp.save`` / ``dcp.load``, single-process when there is no process group."""
    if not _no_dist():
        return function(*args, **kwargs)
    # DCP warns that it assumes a single process; that is exactly what is meant here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return function(*args, no_dist=True, **kwargs)


def save_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: str | Path,
    extra: dict[str, Any],
) -> None:
    """Write the model and optimizer shards of this rank, and ``extra`` from rank 0.

    Collective: every rank must call it with the same ``folder``.

    Args:
        folder: The checkpoint's ``trainer/`` folder; created if missing.
        extra: Small, rank-independent, ``torch.save``-able state.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_SHARDED)
    _dcp_call(
        dcp.save,
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(folder),
    )
    if _no_dist() or dist.get_rank() == 0:
        torch.save(extra, folder / EXTRA_STATE_FILE)


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path
) -> dict[str, Any]:
    """Load this rank's model and optimizer shards in place; return the ``extra`` state.

    Collective. Frozen parameters were not saved: the model must already hold them.

    Args:
        model: The model, already sharded as it will be trained.

    Returns:
        dict[str, Any]: What `save_training_state` got as ``extra``.

    Raises:
        FileNotFoundError: If ``folder`` is not a complete saved training state.
        RuntimeError: If a trainable parameter of ``model`` is not in the saved state (DCP
            names it), or the saved state has parameters the model lacks.
    """
    folder = Path(folder)
    missing = [f for f in (METADATA_FILE, EXTRA_STATE_FILE) if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} is not a saved training state (missing {', '.join(missing)}); a "
            "checkpoint's trainer/ folder holds the sharded model and optimizer state"
        )
    # The current sharded state dicts are DCP's templates, whatever the saving world size.
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_SHARDED)
    state = {"model": model_state, "optimizer": optimizer_state}
    _dcp_call(dcp.load, state, checkpoint_id=str(folder))
    incompatible = set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_SHARDED_LOAD,
    )
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    not_loaded = set(incompatible.missing_keys) - frozen
    if not_loaded or incompatible.unexpected_keys:
        raise RuntimeError(
            f"{folder}: the saved training state does not fit the model: not loaded "
            f"{sorted(not_loaded)[:5]}, unexpected {sorted(incompatible.unexpected_keys)[:5]}"
        )
    return torch.load(folder / EXTRA_STATE_FILE, map_location="cpu", weights_only=False)


def carry_over_hyperparameters(
    optimizer: torch.optim.Optimizer, lr_scheduler: Any, saved_lr: float | None
) -> None:
    """Make a restored optimizer run the config's settings, its LR schedule going on smoothly.

    The lr at the checkpoint's step becomes the saved one times (configured lr / ``saved_lr``)
    and goes on along this run's schedule, so nothing jumps. A resume that changes nothing
    leaves every value as loaded, bit for bit.

    Args:
        saved_lr: The saving run's configured lr; None leaves lr and schedule as loaded.
    """
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            if key != "lr" and key in group:
                group[key] = value
    if saved_lr is None:
        return
    ratio = float(optimizer.defaults["lr"]) / saved_lr
    if lr_scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = float(optimizer.defaults["lr"])
        return
    step = lr_scheduler.last_epoch
    targets = [lr * ratio for lr in lr_scheduler.get_last_lr()]
    # The new schedule's factor at this step (None: not a LambdaLR, no factor to read).
    factors: list[float | None] = (
        [float(fn(step)) for fn in lr_scheduler.lr_lambdas]
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
        else [None] * len(targets)
    )
    bases = []
    for target, factor, old_base in zip(targets, factors, lr_scheduler.base_lrs):
        if factor is not None and factor > 0:
            base = target / factor
        else:
            base = old_base * ratio
            if factor is not None and target > 0:
                log.warning(
                    "the rebuilt LR schedule is 0 at step %d, where the resumed run's lr was "
                    "%g: it cannot go on from that value and follows its own from there",
                    step,
                    target,
                )
        # Unchanged settings give back exactly the saved base (no rounding drift).
        bases.append(old_base if math.isclose(base, old_base, rel_tol=1e-12) else base)
    lr_scheduler.base_lrs = bases
    for group, base, target in zip(optimizer.param_groups, bases, targets):
        group["lr"] = target
        if "initial_lr" in group:
            group["initial_lr"] = base
    lr_scheduler._last_lr = targets
