"""FlexAttention over GRPO packs whose length changes from step to step, as a run's do (CUDA).

Packs ``--packs`` seeded batches as the trainer does (`grpo.packing.packs.pack_sequences`:
``--groups`` prompts of about ``--prompt-len`` tokens, each held once and seen by its
``--group-size`` responses of about ``--response-len``; lengths vary by up to a quarter;
padded to a multiple of `FLEX_BUCKET`), and times forward and backward of compiled
``flex_attention`` on each pack's BlockMask, three ways:

* ``dynamic``: ``torch.compile(dynamic=None)``, which compiles the first length statically and
  the second for any length, with inductor's defaults;
* ``dynamic, divisible``: the same, told that each length is a multiple of the kernel's block
  (`grpo.packing.attention.flex_kernel_options`: what the trainer and reference actor pass);
* ``static``: ``dynamic=False``, one compile per length (at most 8, dynamo's recompile limit).

The packs have ``--packs`` different lengths (seeds whose length repeats are skipped).

Usage:
    python scripts/bench_flex_lengths.py                 # 16 heads of 128, 3 packs of ~16k
    python scripts/bench_flex_lengths.py --heads 32 --head-dim 128 --packs 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import print_table, scored_groups
from torch.nn.attention.flex_attention import flex_attention

from grpo.packing.attention import flex_kernel_options
from grpo.packing.packs import FLEX_BUCKET, pack_sequences


def pack_mask(seed: int, args: argparse.Namespace, device: str = "cuda") -> tuple[object, int]:
    """The BlockMask the trainer builds for a seeded batch (shared prompts, flex padding), and
    the pack's length."""
    batch = scored_groups(
        args.groups,
        args.group_size,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        vocab_size=1000,
        spread=4,
        seed=seed,
    )
    packed = pack_sequences(
        batch, device, 0, mask_kind="flex", pad_to_multiple_of=FLEX_BUCKET, share_prompts=True
    )
    return packed.attention_mask, packed.packed_seq_len


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
    by_length: dict[int, object] = {}  # a pack of a length seen already adds nothing
    seed = 0
    while len(by_length) < args.packs:
        mask, length = pack_mask(seed, args)
        by_length.setdefault(length, mask)
        seed += 1
    masks = [(mask, length) for length, mask in sorted(by_length.items())]
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
