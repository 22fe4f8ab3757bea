"""Checkpoints: the parts' ``state_dict()``s composed into one atomic folder, and restored.

A checkpoint folder ``run_dir/checkpoints/step_NNNNNN`` holds

- ``model/``: the policy as a Hugging Face folder (collectors start from it; rank 0 of the
  trainers writes it);
- ``trainer/``: the trainers' sharded model and optimizer state, each rank writing its own
  shards with ``torch.distributed.checkpoint``, plus LR schedule, counters and RNG
  (`grpo.workers.training_checkpoint`); it loads into any number of trainers;
- ``state.json``: the run state (step, policy version, evaluation history);
- ``config.yaml``: the config the run ran with (a resume compares its own with it:
  `grpo.preflight.resume`);
- ``pipeline.pt``: every other part's state, one flat dict (actor states from the supervisor,
  held groups from the in-flight ledger).

It is written under a temporary name, flushed, and renamed into place; ``latest`` names the
newest, so a crash mid-save leaves the previous checkpoint whole. The trainers write into that
temporary folder from their own processes: with trainers on several nodes, ``output_dir`` must
be on a filesystem every node shares. Like torchtitan's checkpointer, this module knows no part's insides: each part is a
`Stateful` (``state_dict()`` / ``load_state_dict()``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

# Where checkpoints live in a run folder is `grpo.run_folder`'s to say (`grpo validate` checks a
# resume target before anything starts); the checkpointer writes them there.
from grpo.run_folder import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    find_checkpoint,
    latest_checkpoint_text,
)

__all__ = [
    "Checkpointer",
    "Stateful",
    "checkpoint_due",
    "checkpoint_policy_version",
    "find_checkpoint",
    "latest_checkpoint_text",
]


def checkpoint_policy_version(checkpoint_dir: Path) -> int:
    """The policy version of the weights in a checkpoint's ``model/`` folder.

    A checkpoint is always taken at a weight sync (`Orchestrator.save_checkpoint` publishes
    the trainer's weights first when steps were trained since the last one), so its weights
    are exactly the version its run state records.
    """
    return int(json.loads((Path(checkpoint_dir) / "state.json").read_text())["policy_version"])


class Stateful(Protocol):
    """A part of the run that can save and restore itself."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` to disk before it is renamed into place."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())


class Checkpointer:
    """Saves and restores the run state and the pipeline parts, atomically.

    Args:
        run_dir (Path): The run folder; checkpoints go to ``run_dir/checkpoints``.
        run_state (Stateful): Saved as ``state.json`` (JSON-serialisable).
        pipeline (list[Stateful]): Saved together as ``pipeline.pt``; their keys must differ.
        save_model (Callable[[Path], None]): Has the trainers write ``model/`` and
            ``trainer/`` into a folder (the temporary one), returning once all are done.
        config (dict[str, Any] | None): The run's config (``RunConfig.model_dump()``),
            saved as ``config.yaml``; None saves none.
    """

    def __init__(
        self,
        run_dir: Path,
        run_state: Stateful,
        pipeline: list[Stateful],
        save_model: Callable[[Path], None],
        config: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(run_dir) / CHECKPOINTS_DIR
        self.run_state = run_state
        self.pipeline = pipeline
        self.save_model = save_model
        self.config = config

    def save(self, step: int) -> Path:
        """Write checkpoint ``step_NNNNNN`` and point ``latest`` at it.

        Returns:
            Path: The checkpoint folder.
        """
        import torch

        final = self.folder / f"step_{step:06d}"
        tmp = self.folder / f".tmp-step_{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.save_model(tmp)
        pipeline: dict[str, Any] = {}
        for part in self.pipeline:
            state = part.state_dict()
            if shared := pipeline.keys() & state.keys():
                raise ValueError(f"checkpoint parts write the same keys {sorted(shared)}")
            pipeline.update(state)
        torch.save(pipeline, tmp / "pipeline.pt")
        (tmp / "state.json").write_text(json.dumps(self.run_state.state_dict()))
        if self.config is not None:
            import yaml

            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(self.config, sort_keys=False))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = self.folder / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.folder / LATEST_FILE)
        return final

    def load(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint's run state and pipeline state into the parts.

        The trainers and collectors were already started from its weights (see
        `find_checkpoint` and `ActorSupervisor.start_pipeline`).

        Raises:
            ValueError: A part's state does not fit the config (e.g. a different number of
                collectors); the message names the checkpoint.
        """
        import torch

        pipeline = torch.load(checkpoint_dir / "pipeline.pt", weights_only=False)
        try:
            for part in self.pipeline:
                part.load_state_dict(pipeline)
        except ValueError as error:
            raise ValueError(f"{checkpoint_dir} {error}") from error
        self.run_state.load_state_dict(json.loads((checkpoint_dir / "state.json").read_text()))


def checkpoint_due(
    step: int, every_n_steps: int | None, every_n_minutes: float | None, seconds_since_save: float
) -> bool:
    """Whether step ``step`` is checkpointed: every ``checkpoint.save_every_n_steps`` steps, or
    once ``save_every_n_minutes`` have passed since the last checkpoint (or the start).

    Example:
        >>> checkpoint_due(10, 5, None, 0.0), checkpoint_due(7, None, 1, 61.0)
        (True, True)
    """
    if every_n_steps and step % every_n_steps == 0:
        return True
    return bool(every_n_minutes) and seconds_since_save >= 60 * every_n_minutes
