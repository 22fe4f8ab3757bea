"""FlexAttention over GRPO packs whose length changes from step to step, as a run's do (CUDA).

Builds ``--packs`` block-causal masks the way the trainer does (`grpo.packing.packs`: each of
``--groups`` prompts of about ``--prompt-len`` tokens is one block, each of its
``--group-size`` responses of about ``--response-len`` another that also sees the prompt;
lengths vary by up to a quarter, padded to a multiple of `FLEX_BUCKET`), and times forward and
backward of compiled ``flex_attention`` on each, three ways:

* ``dynamic``: ``torch.compile(dynamic=None)``, which compiles the first length statically and
  the second for any length, with inductor's defaults;
* ``dynamic, divisible``: the same, told that each length is a multiple of the kernel's block
  (`grpo.packing.attention.flex_kernel_options`: what the trainer and reference actor pass);
* ``static``: ``dynamic=False``, one compile per length (at most 8, dynamo's recompile limit).

Usage:
    python scripts/bench_flex_lengths.py                 # 16 heads of 128, 3 packs of ~16k
    python scripts/bench_flex_lengths.py --heads 32 --head-dim 128 --packs 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import print_table
from torch.nn.attention.flex_attention import flex_attention

from grpo.packing.attention import flex_kernel_options
from grpo.packing.packs import FLEX_BUCKET, _block_causal_block_mask


def pack_mask(seed: int, args: argparse.Namespace) -> tuple[object, int]:
    """A seeded block-causal BlockMask of shared-prompt groups, and its padded length."""
    generator = torch.Generator().manual_seed(seed)

    def around(length: int) -> int:
        width = length // 4
        return length + int(torch.randint(-width, width + 1, (1,), generator=generator))

    block_ids: list[int] = []
    prefix_ids: list[int] = []
    block = 0
    for _ in range(args.groups):
        prompt_block = block
        length = around(args.prompt_len)
        block_ids += [block] * length
        prefix_ids += [-1] * length
        block += 1
        for _ in range(args.group_size):
            length = around(args.response_len)
            block_ids += [block] * length
            prefix_ids += [prompt_block] * length
            block += 1
    padded = -(-len(block_ids) // FLEX_BUCKET) * FLEX_BUCKET
    block_ids += [block] * (padded - len(block_ids))
    prefix_ids += [-1] * (padded - len(prefix_ids))
    device = torch.device("cuda")
    mask = _block_causal_block_mask(
        torch.tensor(block_ids, device=device), torch.tensor(prefix_ids, device=device), device
    )
    return mask, padded


def time_pack(compiled, mask, length: int, options, args, repeats: int) -> list[float]:
    """Seconds of each forward + backward over one pack of ``length`` tokens."""
    q, k, v = (
        torch.randn(
            1, args.heads, length, args.head_dim, device="cuda", dtype=torch.bfloat16,
            requires_grad=True,
        )
        for _ in range(3)
    )  # fmt: skip
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        compiled(q, k, v, block_mask=mask, kernel_options=options).sum().backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8, help="prompts per pack")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=224)
    parser.add_argument("--packs", type=int, default=3, help="packs of different lengths")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_flex_lengths.py needs a CUDA device (FlexAttention's backward)")
    masks = [pack_mask(seed, args) for seed in range(args.packs)]
    lengths = [length for _, length in masks]
    print(
        f"{torch.cuda.get_device_name()}: {args.heads} heads of {args.head_dim}, bf16; packs of {lengths}"
    )
    rows = []
    for name, dynamic, divisible in (
        ("dynamic", None, False),
        ("dynamic, divisible", None, True),
        ("static", False, False),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=dynamic)
        start = time.perf_counter()
        for mask, length in masks:  # compile (and recompile) first
            options = flex_kernel_options("cuda", length, length) if divisible else None
            time_pack(compiled, mask, length, options, args, 2)
        compile_s = time.perf_counter() - start
        medians = []
        for mask, length in masks:
            options = flex_kernel_options("cuda", length, length) if divisible else None
            medians.append(
                statistics.median(time_pack(compiled, mask, length, options, args, args.repeats))
            )
        rows.append([name, f"{compile_s:.1f}", *(f"{1e3 * m:.2f}" for m in medians)])
        print(f"{name}: {', '.join(rows[-1][2:])} ms", flush=True)
    print_table(
        f"forward + backward, median of {args.repeats} (ms)",
        ["compile", "first calls s", *(f"L={length}" for length in lengths)],
        rows,
    )


if __name__ == "__main__":
    main()
