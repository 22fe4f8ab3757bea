"""Peak host memory of a trainer checkpoint: the optimizer state gathered on rank 0 vs sharded.

Builds a random Qwen2 model of about ``--params`` parameters (`grpo.testing.build_tiny_qwen2`,
a small vocabulary and wide layers), starts ``--world-size`` training workers as plain
processes (FSDP2 over gloo when more than one, on CPU), gives AdamW its state with one step on
zero gradients, and saves a checkpoint twice, each time in fresh processes:

- ``gathered``: the full optimizer state gathered on rank 0
  (``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``) and written with
  ``torch.save`` as one file, plus the HF ``model/`` folder;
- ``sharded``: `PyTorchActorModel.save_checkpoint`: the HF ``model/`` folder, and each rank's
  own model and optimizer shards written with ``torch.distributed.checkpoint``.

A thread samples each rank's RSS every millisecond during the save. The table shows, per
method and rank, RSS before the save, the peak during it, the increase and the save time.
Both methods write the same ``model/`` folder, for which every rank gathers the full weights
(as the weight sync does); the difference is the optimizer state.

One run with the defaults (147M parameters, 2 gloo ranks, 2-core host): rank 0 peaked at
3170 MiB gathered (+1497 MiB during the save) and at 2166 MiB sharded (+469 MiB, the full
weights for ``model/``); rank 1 +569 MiB and +434 MiB. The sharded checkpoint is larger on
disk (2247 vs 1684 MiB): ``trainer/`` holds the sharded weights as well as the optimizer.

Usage:
    python scripts/bench_checkpoint.py                      # ~150M parameters, 2 ranks
    python scripts/bench_checkpoint.py --world-size 1
    python scripts/bench_checkpoint.py --params 300e6 --out-dir /tmp/bench_ckpt
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.multiprocessing as mp

MIB = 2**20


class PeakRss:
    """Samples this process's RSS in a background thread; ``peak`` is the highest seen."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.process = psutil.Process()
        self.interval_s = interval_s
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def save_gathered(trainer: Any, folder: Path) -> None:
    """The single-file layout: the whole optimizer state gathered on rank 0, one torch.save."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    from grpo.models import save_hf_checkpoint

    tune_state = trainer.full_state_dict()
    if trainer.world_size == 1:
        optimizer_state = trainer.optimizer.state_dict()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer_state = get_optimizer_state_dict(
            trainer.policy, trainer.optimizer, options=options
        )
    if trainer.rank != 0:
        return
    save_hf_checkpoint(tune_state, trainer.model_dir, folder / "model")
    torch.save({"optimizer": optimizer_state}, folder / "trainer.pt")


def worker(
    rank: int, world_size: int, method: str, model_dir: str, folder: str, port: int, results: Any
) -> None:
    """One training worker: set up, give AdamW its state, save once while sampling RSS."""
    torch.set_num_threads(1)
    from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

    config = TrainingConfig(optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-5})
    trainer = PyTorchActorModel(
        rank=rank,
        world_size=world_size,
        model_dir=model_dir,
        num_steps=1,
        target_tokens_per_batch=64,
        pad_token_id=0,
        config=config,
    )
    trainer.setup(dist_init_method=f"tcp://127.0.0.1:{port}" if world_size > 1 else None)
    # One step on zero gradients creates AdamW's moments (two tensors per parameter shard).
    for parameter in trainer.policy.parameters():
        parameter.grad = torch.zeros_like(parameter)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if world_size > 1:
        torch.distributed.barrier()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with PeakRss() as rss:
        if method == "gathered":
            save_gathered(trainer, Path(folder))
        else:
            trainer.save_checkpoint(folder)
        if world_size > 1:
            torch.distributed.barrier()
    seconds = time.perf_counter() - start
    num_params = sum(p.numel() for p in trainer.policy.parameters())
    results.put((method, rank, before, rss.peak, seconds, num_params))
    trainer.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_shape(params: float) -> dict[str, int]:
    """Qwen2 arguments for about ``params`` parameters: 1024 wide, ~11M per layer."""
    embed_dim, intermediate_dim, vocab_size = 1024, 2816, 512
    per_layer = 2 * embed_dim * embed_dim + 2 * embed_dim * 256 + 3 * embed_dim * intermediate_dim
    return {
        "num_layers": max(1, round(params / per_layer)),
        "embed_dim": embed_dim,
        "num_heads": 16,
        "num_kv_heads": 4,
        "intermediate_dim": intermediate_dim,
        "vocab_size": vocab_size,
    }


def folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=150e6, help="model size (approx.)")
    parser.add_argument("--world-size", type=int, default=2, help="training workers")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: a temp folder")
    args = parser.parse_args()

    from grpo.testing import build_tiny_qwen2

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_qwen2(out_dir / "model", **model_shape(args.params))
    context = mp.get_context("spawn")
    rows = []
    for method in ("gathered", "sharded"):
        folder = out_dir / f"checkpoint_{method}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        results = context.Queue()
        port = free_port()
        processes = [
            context.Process(
                target=worker,
                args=(rank, args.world_size, method, str(model_dir), str(folder), port, results),
            )
            for rank in range(args.world_size)
        ]
        for process in processes:
            process.start()
        found = sorted((results.get() for _ in processes), key=lambda row: row[1])
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"{method} rank failed with exit code {process.exitcode}")
        rows += [(*row, folder_mib(folder)) for row in found]

    num_params = rows[0][5]  # a DTensor counts its global elements
    print(
        f"\n{num_params / 1e6:.0f}M parameters (fp32, AdamW), {args.world_size} worker(s), "
        f"host {os.cpu_count()} CPUs"
    )
    header = f"{'method':<10}{'rank':>5}{'RSS before':>13}{'peak RSS':>11}{'increase':>11}"
    print(f"{header}{'save s':>9}{'on disk':>10}")
    for method, rank, before, peak, seconds, _, disk in rows:
        print(
            f"{method:<10}{rank:>5}{before / MIB:>9.0f} MiB{peak / MIB:>7.0f} MiB"
            f"{(peak - before) / MIB:>7.0f} MiB{seconds:>9.1f}{disk:>6.0f} MiB"
        )
    if args.out_dir is None:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
