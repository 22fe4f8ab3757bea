"""Sharded training state: model and optimizer saved and loaded per rank with DCP.

The trainers write their part of a checkpoint into its ``trainer/`` folder with
``torch.distributed.checkpoint`` (DCP): every rank writes only the shards it owns (one
``__<rank>_0.distcp`` file each) and rank 0 adds DCP's ``.metadata``, so no rank ever holds
the whole optimizer state (AdamW's two moments are twice the model). Rank 0 also writes the
small, world-size independent rest (LR schedule, counters, RNG) as ``extra.pt``. Only the
trainable parameters are saved: with LoRA (``training.lora``) the adapters and their optimizer
state, not the frozen base, which a resume builds from the base model again.

Loading goes the other way on every rank: DCP reads the slices of the saved tensors that
cover each rank's own shards, so a checkpoint saved by N workers loads into M workers
(1 <-> 2 is tested).

Atomicity is the caller's: the folder passed in is inside the temporary checkpoint folder
that `grpo.orchestrator.checkpointer.Checkpointer` renames into place once every part is
written. Every rank writes into that same folder, so with trainers on several nodes it must
be on a filesystem they all share (NFS, Lustre, ...), like the rest of the checkpoint.

Single worker: there is no process group; DCP then runs in one process (``no_dist``), and
the state dict helpers work on the plain module and optimizer, so the same files result.

A resume may change the optimizer's settings and the run's length: `carry_over_hyperparameters`
makes the restored optimizer and LR schedule run the config's values, with no jump in the lr.
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
"""The folder of a checkpoint that holds the policy as a Hugging Face model folder (full
fine-tuning; collectors start from it)."""

ADAPTER_SUBDIR = "adapter"
"""The folder of a checkpoint that holds the policy's LoRA adapter as a PEFT adapter folder
(``training.lora``; collectors start from the base model and it). Such a checkpoint has no
`MODEL_SUBDIR`."""

EXTRA_STATE_FILE = "extra.pt"
METADATA_FILE = ".metadata"  # written by DCP's coordinator (rank 0) once every shard is written

# Sharded, not gathered: each rank keeps its own shards of parameters and optimizer state.
# Frozen parameters (a LoRA model's base) are left out: they come from the base model, and
# rewriting the unchanged base at every checkpoint would cost time and disk for nothing.
# Full fine-tuning has none, so its files are unchanged.
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True)
# Loading into a model whose frozen parameters are already in place: they are "missing" from
# what was saved, which `load_training_state` checks itself (nothing else may be).
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

    Only the trainable parameters are written (all of them in full fine-tuning, the adapters
    under LoRA), with the optimizer state, which covers exactly those.

    Collective: every rank must call it with the same ``folder``.

    Args:
        model (nn.Module): The (possibly FSDP2-sharded) model the optimizer updates.
        optimizer (torch.optim.Optimizer): Its optimizer.
        folder (str | Path): The checkpoint's ``trainer/`` folder, inside the temporary
            checkpoint folder; created if missing.
        extra (dict[str, Any]): Small, rank-independent state (``torch.save``-able), written
            by rank 0 only.
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

    Collective: every rank must call it. The optimizer may be fresh (no step taken yet):
    its state is initialised first so that DCP knows every tensor's shape and sharding.
    Frozen parameters are not loaded (they were not saved): the model must already hold them.

    Args:
        model (nn.Module): The model, already sharded as it will be trained.
        optimizer (torch.optim.Optimizer): Its optimizer.
        folder (str | Path): A checkpoint's ``trainer/`` folder.

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
    # The current (sharded) state dicts are the templates DCP loads into: it reads, for each
    # tensor, the saved slices that overlap this rank's shard, whatever the saving world size.
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

    Loading a checkpoint puts back the param groups' hyperparameters and the schedule's base
    lrs as they were saved, so a resume with another ``training.optimizer.lr`` (or betas,
    weight decay, ...) would keep the old values, and a schedule rebuilt for a longer
    ``orchestration.num_steps`` would make the lr jump. Here, after loading:

    - every hyperparameter the optimizer was built with (``optimizer.defaults``, from the
      config) is set in each param group, the lr aside;
    - without a schedule the lr is the config's;
    - with one, the lr at the checkpoint's step is the one the run had there, times
      (configured lr / ``saved_lr``), and it goes on from there along the schedule built for
      this run (its ``num_training_steps`` and the config's scheduler settings): the
      schedule's base lrs are scaled so that it passes through that value at that step. A
      longer run thus continues the decay from where it was, stretched over the new length
      (it ends lower than the configured end fraction of the peak when the old schedule had
      already decayed further than the new one at that step). A schedule that is not a
      ``LambdaLR`` (whose lr is not base lr times a function of the step) starts from that
      value with its base lrs scaled by the lr ratio.

    A resume that changes nothing leaves every value as loaded, bit for bit.

    Args:
        optimizer (torch.optim.Optimizer): Built from the config, its state loaded.
        lr_scheduler: Its schedule, built for this run and its state loaded; None if none.
        saved_lr (float | None): The configured lr of the run that saved the checkpoint (its
            ``extra`` state's ``optimizer_lr``); None for a checkpoint that did not record it,
            whose lr and schedule are then left as loaded.
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
