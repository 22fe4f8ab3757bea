"""The trainer alone: tokens/s and MFU of `PyTorchActorModel.train_step` (no Ray, no vLLM).

Builds a random model of ``--shape`` into a temporary folder (``qwen3-1.7b``: Qwen3-1.7B's
shape, 28 layers, hidden 2048, 16 query / 8 KV heads of 128, MLP 6144, vocabulary 151,936;
``tiny``: a few layers, for a check on CPU), and trains it in bf16 on batches of GRPO groups
(``--groups`` prompts of ``--prompt-len`` tokens, each answered by ``--group-size`` responses of
``--response-len``), packed with shared prompts into one pack of ``--tokens`` tokens
(``training.mask_kind=auto``: FlexAttention ``BlockMask`` on CUDA, varlen on CPU). It times
``train_step`` with ``torch.compile`` off and on (``--compile``), AdamW foreach or fused
(``--fused-adamw``), every weight trained or LoRA adapters (``--lora RANK``), after
``--warmup`` steps. ``--spread`` and ``--batches`` vary the lengths
from step to step, as a run's packs do (a compiled model sees new shapes).

MFU is the model's FLOPs per second over the chip's bf16 matmul rate, measured in the same run
(square bf16 matmuls of ``--peak-size``). Model FLOPs per step, forward and backward, no
recomputation:

* 6 x (weights of every linear layer of the decoder) x (tokens in the pack, padding excluded);
* 6 x vocabulary x hidden x (response tokens): the output projection runs only where a
  logprob is needed (4 x for both under LoRA: frozen weights get no gradient);
* 12 x layers x query heads x head dim x (query-key pairs the block-causal mask lets attend:
  a response sees its prompt and itself causally).

Usage:
    python scripts/bench_trainer_mfu.py                        # Qwen3-1.7B shape, 16k tokens
    python scripts/bench_trainer_mfu.py --compile on --fused-adamw both --spread 4 --batches 4 \
        --tokens 18432
    python scripts/bench_trainer_mfu.py --shape tiny --compile off --groups 2 --group-size 4 \
        --tokens 2048 --profile 15
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import print_table, scored_groups, single_trainer

SHAPES = {
    "qwen3-1.7b": dict(
        num_layers=28,
        embed_dim=2048,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_dim=6144,
        vocab_size=151_936,
        max_seq_len=40_960,
    ),
    "tiny": dict(
        num_layers=4,
        embed_dim=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_dim=768,
        vocab_size=512,
        max_seq_len=4096,
    ),
}


# ``--compile`` and ``--fused-adamw``: the settings each one times.
SETTINGS = {"off": [False], "on": [True], "both": [False, True]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: torch.device, size: int, repeats: int = 10) -> float:
    """The chip's measured bf16 matmul rate in FLOP/s: the best of ``repeats`` square matmuls."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def pack_tokens(batch: list) -> int:
    """Tokens of ``batch``'s pack with shared prompts, padding excluded: each prompt once."""
    prompts = {t.group_id: t.prompt_len for t in batch}
    return sum(prompts.values()) + sum(t.response_len for t in batch)


def model_flops(shape: dict, batch: list, lora: bool = False) -> float:
    """Forward + backward FLOPs of one step on ``batch`` (module docstring); with ``lora`` the
    frozen weights take 4 x, not 6 x (no weight gradients; the adapters are left out)."""
    dim, heads, kv_heads = shape["embed_dim"], shape["num_heads"], shape["num_kv_heads"]
    head_dim, layers = shape["head_dim"], shape["num_layers"]
    per_layer = dim * head_dim * (2 * heads + 2 * kv_heads) + 3 * dim * shape["intermediate_dim"]
    prompts = {t.group_id: t.prompt_len for t in batch}  # one copy of each shared prompt
    tokens = pack_tokens(batch)
    responses = sum(t.response_len for t in batch)
    pairs = sum(p * (p + 1) // 2 for p in prompts.values())
    pairs += sum(
        t.prompt_len * t.response_len + t.response_len * (t.response_len + 1) // 2 for t in batch
    )
    weight_passes = 4 if lora else 6
    linear = weight_passes * (layers * per_layer * tokens + shape["vocab_size"] * dim * responses)
    return linear + 12 * layers * heads * head_dim * pairs


def print_profile(trainer, batch: list, top: int) -> None:
    """One more step under ``torch.profiler``: the ``top`` operators by device time (CPU time
    on a CPU), to say where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        trainer.train_step(batch)
        synchronize(trainer.device)
    key = "self_device_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))


def time_steps(
    model_dir: Path, batches: list[list], tokens: int, variant: tuple[bool, bool], args
) -> list[float]:
    """Seconds of every `train_step` of a fresh trainer, warm-up steps first (the first one
    compiles, when on), cycling through ``batches``."""
    compiled, fused = variant
    optimizer = {"_component_": "torch.optim.AdamW", "lr": 1e-6, "fused": fused}
    lora = {"rank": args.lora, "alpha": 2.0 * args.lora} if args.lora else None
    trainer = single_trainer(
        model_dir, tokens, dtype="bf16", compile=compiled, optimizer=optimizer, lora=lora
    )
    times = []
    for step in range(args.warmup + args.steps):
        batch = batches[step % len(batches)]
        synchronize(trainer.device)
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        synchronize(trainer.device)
        times.append(time.perf_counter() - start)
        if metrics["training/num_micro_batches"] != 1:
            raise SystemExit(f"a batch did not fit one pack of {tokens} tokens; raise --tokens")
    if trainer.device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        print(f"{variant_name(variant)}: peak memory {peak_gib:.1f} GiB")
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        print_profile(trainer, batches[0], args.profile)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times


def variant_name(variant: tuple[bool, bool]) -> str:
    compiled, fused = variant
    return f"compile {'on' if compiled else 'off'}, AdamW {'fused' if fused else 'foreach'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=16_384, help="tokens per pack")
    parser.add_argument("--groups", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=224)
    parser.add_argument(
        "--spread",
        type=int,
        default=None,
        help="lengths vary by up to length // SPREAD either way (default: exact lengths)",
    )
    parser.add_argument(
        "--batches", type=int, default=1, help="distinct seeded batches the steps cycle through"
    )
    parser.add_argument("--compile", choices=sorted(SETTINGS), default="both")
    parser.add_argument(
        "--fused-adamw",
        choices=sorted(SETTINGS),
        default="off",
        help="torch.optim.AdamW(fused=True) instead of its foreach default",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="train LoRA adapters of this rank on q/k/v/o (alpha 2 x rank) instead of every weight",
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed")
    parser.add_argument("--steps", type=int, default=5, help="steps timed")
    parser.add_argument(
        "--profile", type=int, default=0, help="print this many top operators of one more step"
    )
    parser.add_argument("--peak-size", type=int, default=None, help="default 8192 GPU, 2048 CPU")
    args = parser.parse_args()
    from grpo.testing import build_tiny_qwen3

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape]
    batches = [
        scored_groups(
            args.groups,
            args.group_size,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            vocab_size=min(shape["vocab_size"], 50_000),
            spread=args.spread,
            seed=seed,
        )
        for seed in range(args.batches)
    ]
    real_tokens = [pack_tokens(b) for b in batches]
    if max(real_tokens) > args.tokens:
        raise SystemExit(f"a batch has {max(real_tokens)} tokens, over --tokens {args.tokens}")
    flops = [model_flops(shape, b, lora=bool(args.lora)) for b in batches]
    peak = matmul_peak(device, args.peak_size or (8192 if device.type == "cuda" else 2048))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"{args.shape} ({', '.join(f'{k}={v}' for k, v in shape.items())}) on {name}, bf16; "
        f"{len(batches[0])} sequences ({args.groups} prompts of {args.prompt_len} + "
        f"{args.group_size} x {args.response_len}"
        f"{f', lengths +-1/{args.spread}' if args.spread else ''}), "
        f"{min(real_tokens):,}-{max(real_tokens):,} tokens in a pack of {args.tokens:,} "
        f"({args.batches} distinct batches){f'; LoRA rank {args.lora}' if args.lora else ''}; "
        f"{statistics.mean(flops) / 1e12:.2f} TFLOP a step; "
        f"measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s"
    )
    rows = []
    variants = [
        (compiled, fused)
        for compiled in SETTINGS[args.compile]
        for fused in SETTINGS[args.fused_adamw]
    ]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        model_dir = build_tiny_qwen3(Path(folder) / "model", **shape)
        print(f"random model written in {time.perf_counter() - start:.0f} s")
        for variant in variants:
            times = time_steps(model_dir, batches, args.tokens, variant, args)
            timed = range(args.warmup, args.warmup + args.steps)
            seconds = sum(times[i] for i in timed)
            step_flops = sum(flops[i % len(batches)] for i in timed)
            step_tokens = sum(real_tokens[i % len(batches)] for i in timed)
            row = [
                variant_name(variant),
                f"{times[0]:.1f}",
                f"{statistics.median(times[i] for i in timed):.3f}",
                f"{max(times[i] for i in timed):.3f}",
                f"{step_tokens / seconds:,.0f}",
                f"{step_flops / seconds / 1e12:.1f}",
                f"{100 * step_flops / seconds / peak:.1f}%",
            ]
            print(f"{row[0]}: {row[2]} s/step (slowest {row[3]}), {row[4]} tokens/s, MFU {row[6]}")
            rows.append(row)
    print_table(
        f"train_step: {args.steps} steps timed after {args.warmup} warm-up steps",
        ["variant", "first step s", "median s", "slowest s", "tokens/s", "TFLOP/s", "MFU"],
        rows,
    )


if __name__ == "__main__":
    main()
