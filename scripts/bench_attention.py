"""Packed (varlen) attention on CPU: SDPA's flash kernel against the matmul path, per block length.

`grpo.packing.attention` runs each bucket of similar-length blocks as one batched attention call.
On CPU in bf16/fp16 it writes attention as two matmuls and a float32 softmax, because torch's
flash kernel is several times slower there than in float32 for short blocks (its backward above
all). This script measures that choice side by side: for each block length (shared prompts of
``--prompt-len`` tokens in front of each response block, as GRPO packs them) and dtype, the
forward and backward of `packed_attention` over one pack, once with the matmul path allowed and
once forced to SDPA, interleaved, medians of ``--repeats``.

``--trainer demo|generation`` times whole bf16 trainer steps instead (`PyTorchActorModel`
in this process, forward, backward and AdamW step) on a batch shaped like `bench_vs_trl.py`'s
workload: the demo model with 8 prompts of ~15 tokens x 8 responses of ~10, or its generation
model (random, built in a temporary folder) with 8 prompts of ~100 tokens x 8 responses of
~190; SDPA against ours, interleaved.

Usage:
    python scripts/bench_attention.py                    # heads 6, head_dim 64, 1 thread
    python scripts/bench_attention.py --heads 16 --head-dim 128 --threads 2
    python scripts/bench_attention.py --trainer demo
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from grpo.packing import attention
from grpo.packing.attention import VarlenMask, packed_attention

BLOCK_LENS = (16, 32, 64, 128, 256, 512)


def pack_mask(block_len: int, prompt_len: int, tokens: int, group_size: int) -> VarlenMask:
    """Groups of one prompt block and ``group_size`` response blocks seeing it, ~``tokens`` long."""
    lens, prefixes = [], []
    while sum(lens) < tokens:
        prompt_index = len(lens)
        lens.append(prompt_len)
        prefixes.append(-1)
        for _ in range(group_size):
            lens.append(block_len)
            prefixes.append(prompt_index)
    return VarlenMask(tuple(lens), tuple(prefixes))


def time_pass(mask: VarlenMask, dtype: torch.dtype, heads: int, head_dim: int) -> float:
    """Seconds of one forward and backward of `packed_attention` over ``mask``."""
    q, k, v = (
        torch.randn(1, heads, mask.seq_len, head_dim, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    start = time.perf_counter()
    out = packed_attention(q, k, v, mask, dropout_p=0.0, is_causal=False)
    out.float().sum().backward()
    return time.perf_counter() - start


def time_trainer_steps(workload: str, repeats: int) -> None:
    """Median bf16 trainer step on a ``workload``-shaped batch, SDPA against ours."""
    from bench_common import scored_groups, single_trainer
    from bench_vs_trl import GENERATION_MODEL

    with tempfile.TemporaryDirectory() as folder:
        if workload == "demo":
            model_dir = Path(__file__).resolve().parents[1] / "assets" / "tiny_arithmetic_qwen2"
            batch = scored_groups(8, 8, prompt_len=15, response_len=10, vocab_size=500, spread=3)
        else:
            from grpo.testing import build_tiny_qwen2

            model_dir = build_tiny_qwen2(Path(folder) / "model", **GENERATION_MODEL)
            batch = scored_groups(8, 8, prompt_len=100, response_len=190, vocab_size=500, spread=3)
        trainer = single_trainer(model_dir, 2048, dtype="bf16")
        tokens = sum(t.prompt_len + t.response_len for t in batch)
        cap = attention.MATMUL_ATTENTION_MAX_SCORES
        times: dict[str, list[float]] = {"sdpa": [], "ours": []}
        for repeat in range(repeats + 1):  # the first round warms up
            for name, limit in (("sdpa", 0), ("ours", cap)):
                attention.MATMUL_ATTENTION_MAX_SCORES = limit
                start = time.perf_counter()
                trainer.train_step(batch)
                if repeat:
                    times[name].append(time.perf_counter() - start)
        attention.MATMUL_ATTENTION_MAX_SCORES = cap
    sdpa, ours = (statistics.median(times[name]) for name in ("sdpa", "ours"))
    print(
        f"{workload}: bf16 trainer step on 64 sequences ({tokens:,} tokens), median of "
        f"{repeats}: SDPA {sdpa * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms, {sdpa / ours:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32, help="shared prompt block length")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per pack")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--trainer", choices=["demo", "generation"], help="time whole trainer steps instead"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.trainer:
        time_trainer_steps(args.trainer, args.repeats)
        return
    cap = attention.MATMUL_ATTENTION_MAX_SCORES
    print(
        f"{args.heads} heads x {args.head_dim}, packs of ~{args.tokens} tokens (groups of a "
        f"{args.prompt_len}-token prompt and 8 responses), {args.threads} thread(s); ms per "
        "forward + backward, median of "
        f"{args.repeats}"
    )
    print(f"{'dtype':>9} {'block':>6} {'sdpa':>8} {'ours':>8} {'sdpa/ours':>10}")
    for dtype in (torch.bfloat16, torch.float32):
        for block_len in BLOCK_LENS:
            mask = pack_mask(block_len, args.prompt_len, args.tokens, group_size=8)
            times: dict[str, list[float]] = {"sdpa": [], "ours": []}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for name, limit in (("sdpa", 0), ("ours", cap)):
                    attention.MATMUL_ATTENTION_MAX_SCORES = limit
                    seconds = time_pass(mask, dtype, args.heads, args.head_dim)
                    if repeat:
                        times[name].append(seconds)
            attention.MATMUL_ATTENTION_MAX_SCORES = cap
            sdpa, ours = (statistics.median(times[name]) for name in ("sdpa", "ours"))
            print(
                f"{str(dtype).removeprefix('torch.'):>9} {block_len:>6} {sdpa * 1e3:>8.1f} "
                f"{ours * 1e3:>8.1f} {sdpa / ours:>9.2f}x"
            )


if __name__ == "__main__":
    main()
