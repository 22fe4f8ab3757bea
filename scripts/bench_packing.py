"""Benchmark sequence packing against pad-to-longest batches on a small torchtune Qwen2 model.

Draws a GSM8K-like batch (prompts 80-250 tokens uniform, one per group; responses log-normal
with median 250, capped at 1024; 16 prompts x 8 samples; seeded) and measures, side by side in
one run:

- padding: pad-to-longest (whole batch, and per micro-batch) against packing into
  ``--budget``-token packs (padded to the budget, to a multiple of 128, or not at all);
- throughput in real (non-padding) tokens per second of the whole batch, for a trainer step
  (forward + backward of a policy-gradient loss on the response logprobs) and for a reference
  forward (no grad). Padded micro-batches hold ``budget // longest`` sequences, so a padded
  micro-batch has about the token budget of a pack. They use right padding with torchtune's
  causal path (``mask=None``, SDPA ``is_causal``): for right padding this is exactly the
  causal+padding mask (real tokens never see the padding after them) and it is the fastest
  padded option, so the baseline is not handicapped. Timings are repeated, variants
  interleaved round-robin, and the median is reported twice: per wall-clock second, and per
  CPU-second of this process. On a machine shared with other work the wall clock measures the
  neighbours as much as the code; with one torch thread (the default here) CPU time measures
  the work itself, so its ratios are the ones to trust there;
- peak memory: each variant runs once in a fresh subprocess; the kernel's resident-set
  high-water mark is reset (``/proc/self/clear_refs``) right before the pass, and the table
  shows VmHWM after it minus VmRSS before it: memory the pass itself needed (activations,
  masks, logits, gradients), without import, model and data. torch's CPU allocator has no
  peak counter, and tracemalloc does not see torch's allocations.

FlexAttention has no CPU backward in torch 2.13, so on CPU the flex mask is measured forward
only; ``varlen`` (per-sequence causal SDPA, `grpo.packing.attention.VarlenMask`) is the CPU training
path, and dense is shown for reference.

Usage:
    python scripts/bench_packing.py            # 16 prompts x 8, 4 layers, 3 repeats
    python scripts/bench_packing.py --quick    # 4 prompts x 8, 2 layers, fewer repeats
    python scripts/bench_packing.py --threads 2 --skip-memory
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchtune.models.qwen2 import qwen2

from grpo.packing.attention import packed_attention, use_packed_attention
from grpo.packing.packs import FLEX_BUCKET, packed_forward_inputs
from grpo.testing.packing import logprobs_from_logits, pack_by_budget, padding_fraction
from grpo.types import PackedTrajectory, ScoredTrajectory

VOCAB_SIZE = 4096
EMBED_DIM = 256
NUM_HEADS = 4
HEAD_DIM = EMBED_DIM // NUM_HEADS
PAD_ID = 0
# padded-batch: the whole batch padded to its longest sequence, then split into micro-batches
# (as trainers that collate a generation batch once do); padded-micro: each micro-batch padded
# to its own longest (the stronger baseline, and the one speedups are quoted against).
BASELINE = "padded-micro"
TRAIN_VARIANTS = ("padded-batch", "padded-micro", "packed-dense", "packed-varlen")
FORWARD_VARIANTS = TRAIN_VARIANTS + ("packed-flex",)


@dataclass
class BenchConfig:
    num_prompts: int
    samples_per_prompt: int
    num_layers: int
    budget: int
    repeats: int
    seed: int


def make_config(args: argparse.Namespace) -> BenchConfig:
    if args.quick:
        return BenchConfig(4, 8, 2, args.budget, args.repeats or 2, args.seed)
    return BenchConfig(16, 8, 4, args.budget, args.repeats or 3, args.seed)


def build_model(config: BenchConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    model = qwen2(
        vocab_size=VOCAB_SIZE,
        num_layers=config.num_layers,
        num_heads=NUM_HEADS,
        num_kv_heads=2,
        embed_dim=EMBED_DIM,
        intermediate_dim=1024,
        max_seq_len=config.budget,
    )
    return use_packed_attention(model)


def gsm8k_like_batch(config: BenchConfig) -> list[ScoredTrajectory]:
    """Groups share a prompt; response lengths are log-normal (median 250, sigma 0.5)."""
    generator = torch.Generator().manual_seed(config.seed)
    batch = []
    for group in range(config.num_prompts):
        prompt_len = int(torch.randint(80, 251, (), generator=generator))
        prompt = torch.randint(1, VOCAB_SIZE, (prompt_len,), generator=generator)
        normal = torch.randn(config.samples_per_prompt, generator=generator)
        response_lens = torch.exp(math.log(250) + 0.5 * normal).round().clamp(1, 1024).long()
        advantages = torch.randn(config.samples_per_prompt, generator=generator)
        for sample, response_len in enumerate(response_lens.tolist()):
            batch.append(
                ScoredTrajectory(
                    prompt_tokens=prompt,
                    response_tokens=torch.randint(
                        1, VOCAB_SIZE, (response_len,), generator=generator
                    ),
                    prompt_len=prompt_len,
                    response_len=response_len,
                    logprobs=torch.zeros(response_len),
                    ref_logprobs=torch.zeros(response_len),
                    rewards=torch.zeros(1),
                    advantages=advantages[sample],
                    successes=torch.zeros(1),
                    answer="",
                    sequence_id=f"{group}-{sample}",
                    group_id=group,
                    reward_metadata={"func_names": ["bench"]},
                    policy_version=0,
                )
            )
    return batch


# ------------------------------------------------------------------- padded baseline


@dataclass
class PaddedMicroBatch:
    tokens: torch.Tensor  # [b, S], right-padded
    response_mask: torch.Tensor  # [b, S], True on response tokens
    advantages: torch.Tensor  # [b]
    real_tokens: int


def padded_micro_batches(
    batch: list[ScoredTrajectory], budget: int, per_micro_batch: bool
) -> list[PaddedMicroBatch]:
    """Consecutive micro-batches of ``budget // longest`` sequences, right-padded.

    Each is padded to its own longest sequence if ``per_micro_batch``, otherwise all are padded
    to the longest of the whole batch.
    """
    longest = max(seq.total_len for seq in batch)
    size = max(1, budget // longest)
    micro_batches = []
    for start in range(0, len(batch), size):
        members = batch[start : start + size]
        width = max(seq.total_len for seq in members) if per_micro_batch else longest
        tokens = torch.full((len(members), width), PAD_ID, dtype=torch.long)
        response_mask = torch.zeros(len(members), width, dtype=torch.bool)
        for row, seq in enumerate(members):
            tokens[row, : seq.total_len] = torch.cat([seq.prompt_tokens, seq.response_tokens])
            response_mask[row, seq.prompt_len : seq.total_len] = True
        micro_batches.append(
            PaddedMicroBatch(
                tokens=tokens,
                response_mask=response_mask,
                advantages=torch.stack([seq.advantages for seq in members]),
                real_tokens=sum(seq.total_len for seq in members),
            )
        )
    return micro_batches


def padded_pass(model: nn.Module, micro_batch: PaddedMicroBatch, normalizer: float, train: bool):
    logits = model(micro_batch.tokens)  # mask=None: causal; right padding needs nothing more
    shifted_mask = micro_batch.response_mask[:, 1:]
    log_probs = logits[:, :-1][shifted_mask].float().log_softmax(-1)
    targets = micro_batch.tokens[:, 1:][shifted_mask]
    logprobs = log_probs.gather(1, targets[:, None]).squeeze(1)
    advantages = micro_batch.advantages[:, None].expand_as(shifted_mask)[shifted_mask]
    loss = -(advantages * logprobs).sum() / normalizer
    if train:
        loss.backward()


def packed_pass(model: nn.Module, packed: PackedTrajectory, normalizer: float, train: bool):
    logits = model(**packed_forward_inputs(packed))
    logprobs = logprobs_from_logits(logits, packed)
    loss = -(packed.advantages * logprobs).sum() / normalizer
    if train:
        loss.backward()


# ------------------------------------------------------------------------- variants


def build_variant(name: str, batch: list[ScoredTrajectory], budget: int) -> list:
    """The micro-batches (padded) or packs (packed-<mask kind>) one pass runs over."""
    if name.startswith("padded"):
        return padded_micro_batches(batch, budget, per_micro_batch=name == "padded-micro")
    mask_kind = name.removeprefix("packed-")
    return pack_by_budget(
        batch, "cpu", PAD_ID, budget, mask_kind=mask_kind, pad_to_multiple_of=FLEX_BUCKET
    )


def make_pass(
    model: nn.Module, name: str, items: list, normalizer: float, train: bool
) -> Callable[[], None]:
    step = padded_pass if name.startswith("padded") else packed_pass

    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            for item in items:
                step(model, item, normalizer, train)

    return run


def warm_up_flex(packs: list[PackedTrajectory]) -> None:
    """Compile FlexAttention for every pack length (CPU compiles per length) on small inputs.

    Calls the attention function directly with random q, k, v of the model's head layout, so
    the compile happens before a measurement without running the model over the batch.
    """
    with torch.no_grad():
        for packed in {pack.packed_seq_len: pack for pack in packs}.values():
            q, k, v = torch.randn(3, 1, NUM_HEADS, packed.packed_seq_len, HEAD_DIM).unbind(0)
            packed_attention(q, k, v, packed.attention_mask, dropout_p=0.0, is_causal=False)


# ---------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def memory_probe(config: BenchConfig, name: str, train: bool) -> None:
    """Run one pass in this (fresh) process; print the peak RSS it added, in MiB, as JSON."""
    model = build_model(config)
    if not train:
        model.eval()
    batch = gsm8k_like_batch(config)
    items = build_variant(name, batch, config.budget)
    normalizer = float(sum(seq.response_len for seq in batch))
    if name == "packed-flex":
        warm_up_flex(items)
    run = make_pass(model, name, items, normalizer, train)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS high-water mark (Linux >= 4.0)
    before = _proc_status_kib("VmRSS")
    run()
    peak = _proc_status_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - before) / 1024}))


def measure_memory(args: argparse.Namespace, name: str, train: bool) -> float | None:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--probe",
        name,
        "--budget",
        str(args.budget),
    ]
    command += ["--seed", str(args.seed), "--threads", str(args.threads)]
    command += ["--quick"] if args.quick else []
    command += [] if train else ["--forward-only"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"memory probe {name} failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


# ------------------------------------------------------------------------------ main


def time_variants(
    model: nn.Module,
    variants: dict[str, list],
    normalizer: float,
    train: bool,
    repeats: int,
) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds per whole-batch pass; one warm-up pass each, variants interleaved."""
    runs = {
        name: make_pass(model, name, items, normalizer, train) for name, items in variants.items()
    }
    for run in runs.values():
        run()
    seconds: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            run()
            seconds[name]["wall"].append(time.perf_counter() - wall_start)
            seconds[name]["cpu"].append(time.process_time() - cpu_start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x 8, 2 layers")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per pack")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: then CPU-seconds measure the work even on a "
        "shared machine; OpenMP workers spin while waiting, which inflates CPU time)",
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--forward-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = make_config(args)
    torch.set_num_threads(args.threads)
    if args.probe:
        memory_probe(config, args.probe, train=not args.forward_only)
        return

    bench_start = time.perf_counter()
    batch = gsm8k_like_batch(config)
    real_tokens = sum(seq.total_len for seq in batch)
    normalizer = float(sum(seq.response_len for seq in batch))
    longest = max(seq.total_len for seq in batch)
    model = build_model(config)
    print(
        f"GSM8K-like batch: {len(batch)} sequences ({config.num_prompts} prompts x "
        f"{config.samples_per_prompt}), {real_tokens:,} real tokens, longest {longest}; "
        f"budget {config.budget} tokens/pack"
    )
    print(
        f"Model: torchtune qwen2, {config.num_layers} layers, dim 256, 4 heads (2 kv), vocab "
        f"{VOCAB_SIZE}, fp32; CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )

    # Padding.
    padded = padded_micro_batches(batch, config.budget, per_micro_batch=True)
    padded_tokens = sum(mb.tokens.numel() for mb in padded)
    static = pack_by_budget(batch, "cpu", PAD_ID, config.budget, pad_to_budget=True)
    start = time.perf_counter()
    bucketed = pack_by_budget(batch, "cpu", PAD_ID, config.budget, pad_to_multiple_of=FLEX_BUCKET)
    pack_ms = (time.perf_counter() - start) * 1e3
    unpadded = pack_by_budget(batch, "cpu", PAD_ID, config.budget)
    lower_bound = math.ceil(real_tokens / config.budget)
    rows = [
        (f"padded-batch: all padded to the longest ({longest})", len(batch) * longest, None),
        (
            f"padded-micro: {len(padded)} micro-batches of {padded[0].tokens.shape[0]}, "
            "each to its longest",
            padded_tokens,
            None,
        ),
        (f"packed, each pack padded to {config.budget}", None, static),
        (f"packed-*: padded to a multiple of {FLEX_BUCKET} (timed below)", None, bucketed),
        ("packed, no padding", None, unpadded),
    ]
    print(f"\nPadding (packs: {len(bucketed)}, lower bound ceil(tokens/budget) = {lower_bound})")
    print(f"  {'layout':<60}{'tokens':>10}{'padding':>10}")
    for label, total, packs in rows:
        if packs is not None:
            total = sum(pack.packed_seq_len for pack in packs)
            fraction = padding_fraction(packs)
        else:
            fraction = 1 - real_tokens / total
        print(f"  {label:<60}{total:>10,}{fraction:>10.1%}")
    print(f"  (building the {len(bucketed)} dense-mask packs took {pack_ms:.0f} ms)")

    # Throughput.
    load_before = os.getloadavg()[0]
    variants = {name: build_variant(name, batch, config.budget) for name in FORWARD_VARIANTS}
    seconds = {
        True: time_variants(
            model, {n: variants[n] for n in TRAIN_VARIANTS}, normalizer, True, config.repeats
        )
    }
    model.eval()
    seconds[False] = time_variants(model, variants, normalizer, False, config.repeats)
    load_after = os.getloadavg()[0]

    memory: dict[tuple[str, bool], float | None] = {}
    if not args.skip_memory:
        for train, names in ((True, TRAIN_VARIANTS), (False, FORWARD_VARIANTS)):
            for name in names:
                memory[(name, train)] = measure_memory(args, name, train)

    print(
        f"\nThroughput: real tokens per second over the whole batch, median of {config.repeats} "
        f"passes,\nper wall-clock second and per CPU-second of this process; speedup vs {BASELINE}; "
        "peak = MiB of RSS\nthe pass added (fresh process)"
    )
    print(
        f"  {'pass':<18}{'variant':<16}{'wall tok/s':>11}{'speedup':>9}"
        f"{'CPU tok/s':>11}{'speedup':>9}{'peak MiB':>10}"
    )
    for train, label in ((True, "forward+backward"), (False, "forward only")):
        timings = seconds[train]
        for name in FORWARD_VARIANTS:
            if name not in timings:
                print(f"  {label:<18}{name:<16}  n/a: torch has no FlexAttention backward on CPU")
                continue
            cells = ""
            for clock in ("wall", "cpu"):
                median = statistics.median(timings[name][clock])
                speedup = statistics.median(timings[BASELINE][clock]) / median
                cells += f"{real_tokens / median:>11,.0f}{speedup:>8.2f}x"
            peak = memory.get((name, train))
            peak_text = f"{peak:,.0f}" if peak is not None else "-"
            print(f"  {label:<18}{name:<16}{cells}{peak_text:>10}")
    print(
        f"  (1-minute load average {load_before:.1f} before and {load_after:.1f} after the "
        f"timings, on {os.cpu_count()} CPUs: above the CPU count, other work shared them)"
    )
    print(f"(whole benchmark: {time.perf_counter() - bench_start:.0f} s)")


if __name__ == "__main__":
    main()
