"""What the benchmark scripts share: the machine's load, a plain-text table, a logged child run,
a batch of scored groups and a trainer to train on it.

The scripts run as ``python scripts/NAME.py``, so this folder is on ``sys.path`` and they
import it as ``bench_common``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def load_average() -> str:
    """The 1/5/15-minute load average and the CPU count, for the start and end of a run."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min, {os.cpu_count()} CPUs)"


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """Left-align the first column, right-align the others."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        line = "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        )
        print(f"  {line}")
        if index == 0:
            print(f"  {'  '.join('-' * w for w in widths)}")


def run_child(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> float:
    """Run ``command`` from the repo root with output to ``log_path``; return its wall seconds.

    Raises:
        RuntimeError: If it fails or times out (with the log's tail).
    """
    from grpo.config import repo_root

    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run(
                command,
                cwd=repo_root(),
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = None
    if returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        status = f"timed out after {timeout_s:.0f} s" if returncode is None else f"rc={returncode}"
        raise RuntimeError(f"{command[:6]}... failed ({status}); end of {log_path}:\n{tail}")
    return time.perf_counter() - start


def scored_groups(
    num_groups: int,
    group_size: int,
    *,
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    spread: int | None = None,
    seed: int = 0,
) -> list:
    """A seeded trainer batch: ``num_groups`` prompts, each answered by ``group_size`` responses.

    Args:
        spread: Lengths vary uniformly by up to ``length // spread`` either way; None: exact.

    Returns:
        list[ScoredTrajectory]: With random tokens, behaviour logprobs and advantages.
    """
    import torch

    from grpo.types import ScoredTrajectory

    generator = torch.Generator().manual_seed(seed)

    def around(length: int) -> int:
        if spread is None:
            return length
        width = max(1, length // spread)
        return max(1, length + int(torch.randint(-width, width + 1, (1,), generator=generator)))

    batch = []
    for group in range(num_groups):
        prompt = torch.randint(0, vocab_size, (around(prompt_len),), generator=generator)
        for sample in range(group_size):
            length = around(response_len)
            batch.append(
                ScoredTrajectory(
                    prompt_tokens=prompt,
                    response_tokens=torch.randint(0, vocab_size, (length,), generator=generator),
                    prompt_len=prompt.numel(),
                    response_len=length,
                    logprobs=-torch.rand(length, generator=generator) * 3,
                    ref_logprobs=None,
                    rewards=torch.tensor([float(sample % 2)]),
                    advantages=torch.randn((), generator=generator),
                    successes=torch.tensor([float(sample % 2)]),
                    answer="-",
                    sequence_id=f"{group}-{sample}",
                    group_id=group,
                    reward_metadata={"func_names": ["toy"]},
                    policy_version=0,
                )
            )
    return batch


def single_trainer(model_dir: str | Path, target_tokens_per_batch: int, **training: Any):
    """A set-up `PyTorchActorModel` of one rank in this process (no Ray), for ``num_steps``
    1000, with ``TrainingConfig(**training)``."""
    from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

    trainer = PyTorchActorModel(
        rank=0,
        world_size=1,
        model_dir=str(model_dir),
        num_steps=1000,
        target_tokens_per_batch=target_tokens_per_batch,
        pad_token_id=0,
        config=TrainingConfig(**training),
    )
    trainer.setup()
    return trainer
