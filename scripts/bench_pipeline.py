"""Benchmark the async GRPO pipeline on the tiny CPU config.

Three measurements, printed as tables and summarised at the end:

1. Pipeline throughput and the per-step time breakdown, from a real short run (``grpo run async_grpo --config
   tiny_arithmetic_cpu``, launched through `grpo.cli.main` in a child process with
   ``WANDB_MODE=disabled`` and a temporary ``output_dir``), read back from its
   ``metrics.jsonl``: generated tokens/s (collector), trained tokens/s (trainer) and the share
   of trainer time spent waiting for data. The first ``--warmup-steps`` training steps are
   skipped: they include Ray and actor start-up and the first generation batches. Rates are
   aggregates (total tokens / total seconds), not means of per-step rates; the "wall" rates
   divide by the wall time between the first and last measured steps (log timestamps).
   The breakdown table gives each step's wall time and the parts that add up to it (buffer
   wait, train compute, weight gather, transfer, engine reload, driver overhead), means over
   the measured steps, next to the generation and scoring busy times that overlap them (see
   `grpo.observability.metrics.step_time_breakdown`).
2. Weight sync against an in-memory copy of the same HF-named state dict, side by side in
   this process: ``{k: v.clone()}``, the trainer-side gather (copy, torchtune -> HF names,
   checksum), optionally ``ray.put`` + ``ray.get``, and the update of a vLLM CPU engine through
   the collector's path (``collective_rpc("grpo_update_weights")`` and `WeightReceiver`), next
   to the pipeline's own ``time_weight_sync (s)`` and the collectors' apply time. The two
   transports between processes are compared in ``scripts/bench_weight_sync.py``.
3. Reference logprobs of a 64-sequence batch, packed (`plan_sequence_packs` + `pack_sequences`
   + `model_response_logprobs`, as `RefActor` does; dense and varlen masks, each with the
   prompt repeated per sequence and with shared prompts) against one sequence at a time with
   the same function, on the pipeline's model with arithmetic-like lengths and (unless
   ``--quick``) on a larger torchtune model with GSM8K-like lengths. All must agree within
   1e-4. Then a training forward + backward of the same batches (varlen, as the trainer runs
   on CPU), shared prompts against repeated ones: the ratio of step times, and the gradients
   checked to agree.

Micro-benchmarks run their variants round-robin after one warm-up call each (the machine may
be shared) and report medians, with one torch thread by default (``--threads``), as the
pipeline's actors have: Ray sets ``OMP_NUM_THREADS`` to an actor's ``num_cpus``. They run in
this process; the reference logprobs before the vLLM engine starts, since its CPU worker binds
threads and memory for the whole process. The load average is printed at the start and the end.

The model is ``--model-dir``, else ``assets/tiny_arithmetic_qwen2`` if it exists, else a random
Qwen2 of the same shape built with `grpo.testing.build_tiny_qwen2` in a temporary folder (a
random policy earns no reward, so its loss is 0, but every step does the same work).

Usage:
    python scripts/bench_pipeline.py            # about 5 min on 2 cores
    python scripts/bench_pipeline.py --quick    # about 2 min: 5 steps, no Ray timing, short batch
    python scripts/bench_pipeline.py --model-dir assets/tiny_arithmetic_qwen2 --steps 30
    python scripts/bench_pipeline.py --pipeline-only --steps 16 --warmup-steps 3
    python scripts/bench_pipeline.py --packing-only --skip-long  # section 3 only, ~1 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM logs every engine step at INFO; the tables are the output of this script.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from bench_common import load_average, print_table, run_child

from grpo.config import repo_root  # noqa: E402
from grpo.models import build_model, load_hf_config, tune_to_hf_state_dict  # noqa: E402
from grpo.observability.metric_names import (  # noqa: E402
    INFERENCE_GENERATED_TOKENS,
    INFERENCE_TIME_GENERATION,
    INFERENCE_TIME_WEIGHT_UPDATE,
    TRAIN_PERF_STEP_WALL_TIME,
    TRAIN_PERF_TIME_GENERATION_BUSY,
    TRAIN_PERF_TIME_GRPO_STEPS,
    TRAIN_PERF_TIME_SCORING_BUSY,
    TRAIN_PERF_TIME_WAITING_BUFFER,
    TRAIN_PERF_TIME_WEIGHT_GATHER,
    TRAIN_PERF_TIME_WEIGHT_SYNC,
    TRAIN_PERF_TOKENS_PER_SECOND,
    TRAIN_PERF_TOTAL_STEP_TIME,
)
from grpo.observability.metrics import WALL_PARTS  # noqa: E402
from grpo.packing.logprobs import model_response_logprobs  # noqa: E402
from grpo.packing.packs import (  # noqa: E402
    pack_sequences,
    plan_sequence_packs,
    unpack_response_logprobs,
)
from grpo.testing import build_tiny_qwen2  # noqa: E402
from grpo.types import UnscoredTrajectory  # noqa: E402
from grpo.weights.checksum import state_dict_checksum  # noqa: E402
from grpo.weights.engine import (  # noqa: E402
    WORKER_EXTENSION_CLS,
    WeightReceiver,
    WeightUpdate,
)

CONFIG = "tiny_arithmetic_cpu"
# Shape of the shipped demo model (scripts/build_tiny_arithmetic_model.py defaults).
TINY_MODEL_SHAPE = {
    "num_layers": 4,
    "embed_dim": 128,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_dim": 512,
}
# "Slightly larger" model for GSM8K-like lengths (wider; 2 layers keep the run short); head dim
# 64 like the tiny one.
LONG_MODEL_SHAPE = {
    "num_layers": 2,
    "embed_dim": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_dim": 1024,
    "vocab_size": 2048,
    "max_seq_len": 4096,
}
LOGPROB_ATOL = 1e-4
# No pack is padded here (no budget padding is asked for), so the pad id is never used.
PAD_ID = 0


def time_interleaved(
    functions: dict[str, Callable[[], Any]], repeats: int, warm_up: bool = True
) -> dict[str, list[float]]:
    """Seconds of each call: one untimed warm-up call each, then ``repeats`` rounds in turn."""
    if warm_up:
        for function in functions.values():
            function()
    seconds: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - start)
    return seconds


# ------------------------------------------------------------------------ model


def resolve_model_dir(model_dir: Path | None, work_dir: Path) -> tuple[Path, str]:
    """The model folder to benchmark, and a line that says what it is."""
    if model_dir is not None:
        return model_dir.resolve(), f"{model_dir} (--model-dir)"
    shipped = repo_root() / "assets" / "tiny_arithmetic_qwen2"
    if shipped.is_dir():
        return shipped, f"{shipped} (shipped demo model)"
    built = build_tiny_qwen2(work_dir / "tiny_random_qwen2", **TINY_MODEL_SHAPE)
    shape = ", ".join(f"{key}={value}" for key, value in TINY_MODEL_SHAPE.items())
    return built, f"random tiny Qwen2 ({shape}; {shipped} does not exist)"


def describe_model(model_dir: Path) -> str:
    config = load_hf_config(model_dir)
    return (
        f"{config['num_hidden_layers']} layers, dim {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} kv), "
        f"vocab {config['vocab_size']}"
    )


# -------------------------------------------------------------- 1. the pipeline


@dataclass
class PipelineResult:
    """Aggregates of one run's ``metrics.jsonl`` over the measured (post-warm-up) steps."""

    steps: int
    warmup_steps: int
    measured_steps: int
    run_seconds: float
    first_step_wait_s: float
    window_s: float
    generated_tokens: float
    generation_s: float
    window_generated_tokens: float
    trained_tokens: float
    grpo_s: float
    mean_step_tokens_per_s: float
    waiting_s: float
    step_s: float
    weight_sync_s: list[float]
    weight_gather_s: list[float]
    collector_update_s: list[float]
    # Mean seconds per measured step of each breakdown metric the run logged.
    breakdown: dict[str, float]

    @property
    def seconds_per_step(self) -> float:
        return self.window_s / self.measured_steps

    @property
    def generation_rate(self) -> float:
        return self.generated_tokens / self.generation_s if self.generation_s else math.nan

    @property
    def generation_wall_rate(self) -> float:
        return self.window_generated_tokens / self.window_s if self.window_s else math.nan

    @property
    def train_rate(self) -> float:
        return self.trained_tokens / self.grpo_s if self.grpo_s else math.nan

    @property
    def train_wall_rate(self) -> float:
        return self.trained_tokens / self.window_s if self.window_s else math.nan


def run_pipeline(
    model_dir: Path, out_dir: Path, steps: int, timeout_s: float
) -> tuple[list[dict[str, Any]], float]:
    """Run the recipe in a child process; return its metrics.jsonl rows and wall seconds.

    A child process keeps the run's Ray cluster, threads and vLLM logs out of this process;
    its output goes to ``out_dir/run.log``.

    Raises:
        RuntimeError: If the run fails or writes no metrics (the log's tail is in the message).
    """
    overrides = [
        f"base_model_path={model_dir}",
        f"output_dir={out_dir}",
        f"orchestration.num_steps={steps}",
        "eval_every_n_steps=null",  # held-out evaluation is not part of the step loop's cost
    ]
    command = [
        sys.executable,
        "-c",
        "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))",
        *["run", "async_grpo", "--config", CONFIG, *overrides],
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    log_path = out_dir.parent / f"{out_dir.name}.log"
    seconds = run_child(command, log_path, timeout_s, env)
    metrics_path = out_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"pipeline run wrote no metrics; end of {log_path}:\n{tail}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return rows, seconds


def summarize_pipeline(
    rows: list[dict[str, Any]], steps: int, warmup_steps: int, run_seconds: float
) -> PipelineResult:
    """Aggregate the train and inference rows logged after the warm-up steps.

    The measured window runs from the log time of training step ``warmup_steps`` to that of
    the last step; inference batches logged inside it count towards the wall rate.

    Raises:
        ValueError: If the log has no training step after the warm-up.
    """
    train_rows = sorted(
        (r for r in rows if TRAIN_PERF_TOTAL_STEP_TIME in r), key=lambda r: r["step"]
    )
    inference_rows = sorted(
        (r for r in rows if INFERENCE_GENERATED_TOKENS in r), key=lambda r: r["time"]
    )
    measured = [r for r in train_rows if r["step"] > warmup_steps]
    before = [r for r in train_rows if r["step"] <= warmup_steps]
    if not measured or not before:
        raise ValueError(
            f"metrics.jsonl has training steps {[r['step'] for r in train_rows]}; need steps "
            f"<= warmup_steps={warmup_steps} and after it (raise --steps)"
        )
    window_start, window_end = before[-1]["time"], measured[-1]["time"]
    in_window = [r for r in inference_rows if window_start < r["time"] <= window_end]
    # Batches generated after the warm-up steps (the first ones include engine warm-up).
    late_inference = [r for r in inference_rows if r["time"] > window_start]

    def total(selected: list[dict[str, Any]], key: str) -> float:
        return float(sum(r.get(key, 0.0) for r in selected))

    # The trainer reports response tokens * epochs / time_grpo_steps; multiply back.
    trained = [r[TRAIN_PERF_TOKENS_PER_SECOND] * r[TRAIN_PERF_TIME_GRPO_STEPS] for r in measured]
    return PipelineResult(
        steps=steps,
        warmup_steps=warmup_steps,
        measured_steps=len(measured),
        run_seconds=run_seconds,
        first_step_wait_s=float(train_rows[0][TRAIN_PERF_TIME_WAITING_BUFFER]),
        window_s=window_end - window_start,
        generated_tokens=total(late_inference, INFERENCE_GENERATED_TOKENS),
        generation_s=total(late_inference, INFERENCE_TIME_GENERATION),
        window_generated_tokens=total(in_window, INFERENCE_GENERATED_TOKENS),
        trained_tokens=float(sum(trained)),
        grpo_s=total(measured, TRAIN_PERF_TIME_GRPO_STEPS),
        mean_step_tokens_per_s=statistics.mean(r[TRAIN_PERF_TOKENS_PER_SECOND] for r in measured),
        waiting_s=total(measured, TRAIN_PERF_TIME_WAITING_BUFFER),
        step_s=total(measured, TRAIN_PERF_TOTAL_STEP_TIME),
        weight_sync_s=[
            r[TRAIN_PERF_TIME_WEIGHT_SYNC] for r in measured if TRAIN_PERF_TIME_WEIGHT_SYNC in r
        ],
        weight_gather_s=[
            r[TRAIN_PERF_TIME_WEIGHT_GATHER] for r in measured if TRAIN_PERF_TIME_WEIGHT_GATHER in r
        ],
        collector_update_s=[
            r[INFERENCE_TIME_WEIGHT_UPDATE]
            for r in late_inference
            if r.get(INFERENCE_TIME_WEIGHT_UPDATE, 0.0) > 0
        ],
        breakdown={
            key: statistics.mean(r[key] for r in measured)
            for key in (
                TRAIN_PERF_STEP_WALL_TIME,
                *WALL_PARTS,
                TRAIN_PERF_TIME_GENERATION_BUSY,
                TRAIN_PERF_TIME_SCORING_BUSY,
            )
            if all(key in r for r in measured)
        },
    )


def print_pipeline(result: PipelineResult) -> None:
    r = result
    print_table(
        f"1. Pipeline: {r.steps}-step run of {CONFIG} ({r.run_seconds:.0f} s with start-up; "
        f"first step waited {r.first_step_wait_s:.1f} s for data). Warm-up: steps "
        f"1-{r.warmup_steps} skipped; {r.measured_steps} steps measured over a "
        f"{r.window_s:.1f} s window.",
        ["metric", "value", "how"],
        [
            [
                "generated tokens/s (engine)",
                f"{r.generation_rate:,.0f}",
                f"{r.generated_tokens:,.0f} tokens / {r.generation_s:.2f} s in llm.generate",
            ],
            [
                "generated tokens/s (wall)",
                f"{r.generation_wall_rate:,.0f}",
                f"{r.window_generated_tokens:,.0f} tokens / {r.window_s:.1f} s window",
            ],
            [
                "trained tokens/s (trainer)",
                f"{r.train_rate:,.0f}",
                f"{r.trained_tokens:,.0f} response tokens / {r.grpo_s:.2f} s of GRPO steps "
                f"(mean of per-step rates: {r.mean_step_tokens_per_s:,.0f})",
            ],
            [
                "trained tokens/s (wall)",
                f"{r.train_wall_rate:,.0f}",
                f"{r.trained_tokens:,.0f} tokens / {r.window_s:.1f} s window",
            ],
            [
                "trainer time waiting for data",
                f"{r.waiting_s / r.step_s:.1%}" if r.step_s else "n/a",
                f"{r.waiting_s:.2f} s / {r.step_s:.2f} s total_step_time "
                f"({r.waiting_s / r.window_s:.1%} of the wall window)",
            ],
            [
                "weight sync, pipeline (s)",
                _median_text(r.weight_sync_s, "{:.3f}"),
                f"median of {len(r.weight_sync_s)}; trainer gather alone "
                f"{_median_text(r.weight_gather_s, '{:.3f}')} s",
            ],
            [
                "weight apply in collector (s)",
                _median_text(r.collector_update_s, "{:.3f}"),
                f"median of {len(r.collector_update_s)} (inference/time_weight_update)",
            ],
        ],
    )


def print_breakdown(result: PipelineResult) -> None:
    """The mean step's wall time and its parts; busy times that overlap them apart."""
    b = result.breakdown
    if TRAIN_PERF_STEP_WALL_TIME not in b:
        return
    wall = b[TRAIN_PERF_STEP_WALL_TIME]

    def short(key: str) -> str:
        return key.split("/", 1)[1]

    rows = [[short(key), f"{b[key]:.3f}", f"{b[key] / wall:.1%}"] for key in WALL_PARTS if key in b]
    rows.append(["sum of the parts", f"{sum(b[k] for k in WALL_PARTS if k in b):.3f}", ""])
    rows.append([short(TRAIN_PERF_STEP_WALL_TIME), f"{wall:.3f}", "100.0%"])
    rows.append(
        ["s/step over the window (log times)", f"{result.seconds_per_step:.3f}", "(incl. logging)"]
    )
    for key in (TRAIN_PERF_TIME_GENERATION_BUSY, TRAIN_PERF_TIME_SCORING_BUSY):
        if key in b:
            rows.append([f"{short(key)} (overlaps, not in the sum)", f"{b[key]:.3f}", ""])
    print_table(
        f"1b. Per-step time breakdown: means over {result.measured_steps} measured steps",
        ["part", "s/step", "of wall"],
        rows,
    )


def _median_text(values: list[float], fmt: str) -> str:
    return fmt.format(statistics.median(values)) if values else "n/a"


# ------------------------------------------------------------- 2. weight sync


def bench_weight_sync(
    model_dir: Path, repeats: int, use_ray: bool
) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds of each way to move the model's HF state dict, measured in turn.

    Returns:
        tuple: ``{operation: median seconds}`` and facts about the state dict.
    """
    from grpo.testing import set_vllm_cpu_env, tiny_vllm_engine_kwargs

    hf_config = load_hf_config(model_dir)
    model = build_model(model_dir).eval()
    tune_state = model.state_dict()
    hf_state = tune_to_hf_state_dict(tune_state, hf_config)
    checksum = state_dict_checksum(hf_state)
    facts = {
        "tensors": len(hf_state),
        "parameters": sum(t.numel() for t in hf_state.values()),
        "mib": sum(t.numel() * t.element_size() for t in hf_state.values()) / 2**20,
    }

    set_vllm_cpu_env()
    from vllm import LLM

    engine_kwargs = tiny_vllm_engine_kwargs(max_model_len=128, kv_cache_mib=16)
    start = time.perf_counter()
    llm = LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION_CLS, **engine_kwargs)
    facts["engine_start_s"] = time.perf_counter() - start

    receiver = WeightReceiver()
    version = 0

    def clone() -> None:
        {name: tensor.clone() for name, tensor in hf_state.items()}

    # The same bytes without fresh allocations: memory bandwidth alone. (Fresh pages can be
    # expensive in a VM; a clone pays for them, a copy into reused buffers does not.)
    buffers = {name: torch.empty_like(tensor) for name, tensor in hf_state.items()}

    def copy_into() -> None:
        for name, tensor in hf_state.items():
            buffers[name].copy_(tensor)

    def trainer_gather() -> None:
        # What PyTorchActorModel.publish_weights does besides its probe forward.
        copied = {name: t.detach().to("cpu", copy=True) for name, t in tune_state.items()}
        state_dict_checksum(tune_to_hf_state_dict(copied, hf_config))

    def engine_rpc() -> None:
        llm.collective_rpc("grpo_update_weights", args=(hf_state, False))

    def engine_receiver() -> None:
        nonlocal version
        version += 1
        receiver.offer(WeightUpdate(version=version, weights=hf_state, checksum=checksum), 0)
        receiver.apply_pending(llm, verify=True)  # raises if the engine got other tensors

    functions: dict[str, Callable[[], Any]] = {
        "clone": clone,
        "copy_into": copy_into,
        "trainer_gather": trainer_gather,
        "engine_rpc": engine_rpc,
        "engine_receiver": engine_receiver,
    }
    if use_ray:
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        facts["ray_init_s"] = time.perf_counter() - start
        functions["ray_put_get"] = lambda: ray.get(ray.put(hf_state))
    try:
        seconds = time_interleaved(functions, repeats)
    finally:
        if use_ray:
            ray.shutdown()
    return {name: statistics.median(values) for name, values in seconds.items()}, facts


def print_weight_sync(
    medians: dict[str, float], facts: dict[str, Any], pipeline: PipelineResult | None, repeats: int
) -> None:
    base = medians["clone"]
    rows = [
        ["(a) in-memory copy {k: v.clone()}", medians["clone"]],
        ["    copy_ into preallocated tensors", medians["copy_into"]],
        ["    trainer gather: copy + tune->HF names + checksum", medians["trainer_gather"]],
    ]
    if "ray_put_get" in medians:
        rows.append(["(b) ray.put + ray.get (same process)", medians["ray_put_get"]])
    rows += [
        ["(c) engine update: collective_rpc, no checksum", medians["engine_rpc"]],
        ["    engine update: WeightReceiver (checksum, cache reset)", medians["engine_receiver"]],
    ]
    if pipeline is not None and pipeline.weight_sync_s:
        rows.append(
            [
                "(d) pipeline time_weight_sync (gather, put, send)",
                statistics.median(pipeline.weight_sync_s),
            ]
        )
    if pipeline is not None and pipeline.collector_update_s:
        rows.append(
            [
                "    pipeline collector apply (time_weight_update)",
                statistics.median(pipeline.collector_update_s),
            ]
        )
    extra = f"; Ray start-up {facts['ray_init_s']:.1f} s" if "ray_init_s" in facts else ""
    print_table(
        f"2. Weight sync of {facts['parameters'] / 1e6:.2f}M parameters ({facts['tensors']} "
        f"tensors, {facts['mib']:.1f} MiB fp32). Medians of {repeats} (pipeline rows: medians "
        f"over its steps). vLLM CPU engine start-up {facts['engine_start_s']:.1f} s{extra}.",
        ["operation", "ms", "x copy"],
        [[name, f"{value * 1e3:,.2f}", f"{value / base:,.1f}"] for name, value in rows],
    )


# ------------------------------------------------------------ 3. ref logprobs


def synthetic_batch(
    num_prompts: int,
    group_size: int,
    vocab_size: int,
    prompt_range: tuple[int, int],
    response_len: Callable[[torch.Generator], int],
    seed: int,
) -> list[UnscoredTrajectory]:
    """Groups of ``group_size`` responses sharing a prompt; random token ids, seeded."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for group in range(num_prompts):
        prompt_len = int(
            torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=generator)
        )
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=generator)
        for sample in range(group_size):
            length = response_len(generator)
            batch.append(
                UnscoredTrajectory(
                    prompt_tokens=prompt,
                    response_tokens=torch.randint(0, vocab_size, (length,), generator=generator),
                    prompt_len=prompt_len,
                    response_len=length,
                    logprobs=torch.zeros(length),
                    answer="",
                    sequence_id=f"{group}-{sample}",
                    policy_version=0,
                    group_id=group,
                )
            )
    return batch


def uniform_lengths(low: int, high: int) -> Callable[[torch.Generator], int]:
    return lambda generator: int(torch.randint(low, high + 1, (), generator=generator))


def lognormal_lengths(median: float, sigma: float, cap: int) -> Callable[[torch.Generator], int]:
    def draw(generator: torch.Generator) -> int:
        normal = float(torch.randn((), generator=generator))
        return int(min(cap, max(1, round(median * math.exp(sigma * normal)))))

    return draw


@torch.no_grad()
def ref_logprobs_packed(
    model: torch.nn.Module,
    batch: list[UnscoredTrajectory],
    budget: int,
    mask_kind: str,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """As `RefActor.reference_logprobs`: whole groups packed into ``budget``-token packs."""
    plan = plan_sequence_packs(
        batch, budget, share_prompts=share_prompts, keep_groups_together=True
    )
    results: list[torch.Tensor | None] = [None] * len(batch)
    for pack_indices in plan:
        members = [batch[i] for i in pack_indices]
        packed = pack_sequences(
            members, "cpu", PAD_ID, mask_kind=mask_kind, share_prompts=share_prompts
        )
        logprobs = model_response_logprobs(model, packed)
        for index, values in zip(pack_indices, unpack_response_logprobs(packed, logprobs)):
            results[index] = values
    return results


def packed_tokens(batch: list[UnscoredTrajectory], budget: int, share_prompts: bool) -> int:
    """Tokens the model computes on for ``batch`` in ``budget``-token packs (no padding)."""
    plan = plan_sequence_packs(batch, budget, share_prompts=share_prompts)
    return sum(
        pack_sequences(
            [batch[i] for i in indices], "cpu", PAD_ID, share_prompts=share_prompts
        ).actual_total_tokens
        for indices in plan
    )


@torch.no_grad()
def ref_logprobs_single(
    model: torch.nn.Module, batch: list[UnscoredTrajectory]
) -> list[torch.Tensor]:
    """One forward per sequence, through the same pack-of-one path."""
    return [model_response_logprobs(model, pack_sequences([seq], "cpu", PAD_ID)) for seq in batch]


@dataclass
class RefResult:
    label: str
    model: str
    num_sequences: int
    tokens: int
    response_tokens: int
    longest: int
    num_packs: int
    budget: int
    seconds: dict[str, float]
    max_abs_diff: float
    shared_tokens: int  # tokens computed with shared prompts


def bench_ref_logprobs(
    label: str,
    model_dir: Path,
    batch: list[UnscoredTrajectory],
    budget: int,
    repeats: int,
) -> RefResult:
    """Median seconds of the whole batch: packed (dense, varlen masks) vs one at a time.

    Raises:
        AssertionError: If packed and one-at-a-time logprobs differ by more than 1e-4.
    """
    from grpo.packing.attention import use_packed_attention

    # Dense masks take torchtune's unchanged SDPA path; varlen needs the patched attention.
    model = use_packed_attention(build_model(model_dir).eval())
    variants: dict[str, Callable[[], list[torch.Tensor]]] = {
        "packed (dense mask)": lambda: ref_logprobs_packed(model, batch, budget, "dense"),
        "packed (varlen)": lambda: ref_logprobs_packed(model, batch, budget, "varlen"),
        "packed (dense, shared prompts)": lambda: ref_logprobs_packed(
            model, batch, budget, "dense", share_prompts=True
        ),
        "packed (varlen, shared prompts)": lambda: ref_logprobs_packed(
            model, batch, budget, "varlen", share_prompts=True
        ),
        "one at a time": lambda: ref_logprobs_single(model, batch),
    }
    results = {name: variant() for name, variant in variants.items()}
    single = results["one at a time"]
    max_abs_diff = max(
        float((a - b).abs().max()) if a.numel() else 0.0
        for values in results.values()
        for a, b in zip(values, single)
    )
    if not max_abs_diff <= LOGPROB_ATOL:
        raise AssertionError(
            f"{label}: packed and one-at-a-time reference logprobs differ by {max_abs_diff:.2e} "
            f"(max abs), more than {LOGPROB_ATOL:.0e}"
        )
    # The agreement check above ran every variant once: that was the warm-up.
    seconds = time_interleaved(variants, repeats, warm_up=False)
    plan = plan_sequence_packs(batch, budget, keep_groups_together=True)
    return RefResult(
        label=label,
        model=describe_model(model_dir),
        num_sequences=len(batch),
        tokens=sum(t.total_len for t in batch),
        response_tokens=sum(t.response_len for t in batch),
        longest=max(t.total_len for t in batch),
        num_packs=len(plan),
        budget=budget,
        seconds={name: statistics.median(values) for name, values in seconds.items()},
        max_abs_diff=max_abs_diff,
        shared_tokens=packed_tokens(batch, budget, share_prompts=True),
    )


def print_ref(result: RefResult, repeats: int) -> None:
    base = result.seconds["one at a time"]
    print_table(
        f"3. Reference logprobs, {result.label}: {result.num_sequences} sequences, "
        f"{result.tokens:,} tokens ({result.response_tokens:,} response), longest "
        f"{result.longest}; {result.num_packs} pack(s) of <= {result.budget}; model "
        f"{result.model}; {result.shared_tokens:,} tokens with shared prompts. Median of "
        f"{repeats}; packed vs single max |diff| {result.max_abs_diff:.1e} "
        f"(<= {LOGPROB_ATOL:.0e} checked).",
        ["variant", "ms", "tokens/s", "x one at a time"],
        [
            [
                name,
                f"{value * 1e3:,.1f}",
                f"{result.tokens / value:,.0f}",
                f"{base / value:.2f}",
            ]
            for name, value in result.seconds.items()
        ],
    )


def train_forward_backward(
    model: torch.nn.Module, batch: list[UnscoredTrajectory], budget: int, share_prompts: bool
) -> None:
    """One training pass as the trainer makes it on CPU: varlen packs, chunked logprobs,
    backward per micro-batch (a per-sequence weight stands in for the GRPO loss)."""
    model.zero_grad(set_to_none=True)
    for indices in plan_sequence_packs(batch, budget, share_prompts=share_prompts):
        packed = pack_sequences(
            [batch[i] for i in indices],
            "cpu",
            PAD_ID,
            mask_kind="varlen",
            share_prompts=share_prompts,
        )
        weights = torch.cat(
            [torch.full((batch[i].response_len,), 1.0 + (i % 5) / 5.0) for i in indices]
        )
        (weights * model_response_logprobs(model, packed)).sum().backward()


@dataclass
class TrainResult:
    label: str
    num_sequences: int
    tokens: int  # prompts repeated per sequence
    shared_tokens: int
    seconds: dict[str, float]
    max_grad_diff: float


def bench_train_step(
    label: str, model_dir: Path, batch: list[UnscoredTrajectory], budget: int, repeats: int
) -> TrainResult:
    """Median seconds of a training forward + backward, prompts repeated vs shared.

    Raises:
        AssertionError: If the two give gradients that differ by more than 1e-4 of their scale.
    """
    from grpo.packing.attention import use_packed_attention

    model = use_packed_attention(build_model(model_dir).train())
    grads = []
    for share_prompts in (False, True):
        train_forward_backward(model, batch, budget, share_prompts)
        grads.append([param.grad.clone() for param in model.parameters()])
    max_grad_diff = max(
        float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) for a, b in zip(*grads)
    )
    if not max_grad_diff <= LOGPROB_ATOL:
        raise AssertionError(
            f"{label}: shared-prompt gradients differ from the unshared ones by "
            f"{max_grad_diff:.2e} of their scale, more than {LOGPROB_ATOL:.0e}"
        )
    seconds = time_interleaved(
        {
            "prompts repeated": lambda: train_forward_backward(model, batch, budget, False),
            "shared prompts": lambda: train_forward_backward(model, batch, budget, True),
        },
        repeats,
        warm_up=False,  # the gradient check above ran both once
    )
    return TrainResult(
        label=label,
        num_sequences=len(batch),
        tokens=sum(t.total_len for t in batch),
        shared_tokens=packed_tokens(batch, budget, share_prompts=True),
        seconds={name: statistics.median(values) for name, values in seconds.items()},
        max_grad_diff=max_grad_diff,
    )


def print_train(result: TrainResult, repeats: int) -> None:
    base = result.seconds["prompts repeated"]
    tokens = {"prompts repeated": result.tokens, "shared prompts": result.shared_tokens}
    print_table(
        f"3b. Training forward + backward (varlen), {result.label}: {result.num_sequences} "
        f"sequences. Median of {repeats}; gradients agree to {result.max_grad_diff:.1e} of "
        f"their scale (<= {LOGPROB_ATOL:.0e} checked).",
        ["variant", "tokens computed", "ms", "x prompts repeated"],
        [
            [name, f"{tokens[name]:,}", f"{value * 1e3:,.1f}", f"{base / value:.2f}"]
            for name, value in result.seconds.items()
        ],
    )


# ------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="HF model folder")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps not measured")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--quick", action="store_true", help="about 2 minutes")
    parser.add_argument("--no-ray", action="store_true", help="skip the ray.put/get timing")
    parser.add_argument("--skip-run", action="store_true", help="skip the pipeline run")
    parser.add_argument("--skip-long", action="store_true", help="skip the GSM8K-like batch")
    parser.add_argument(
        "--pipeline-only", action="store_true", help="only the pipeline run and its breakdown"
    )
    parser.add_argument(
        "--packing-only",
        action="store_true",
        help="only section 3: reference logprobs and the training pass, packed variants",
    )
    parser.add_argument("--run-timeout", type=float, default=420.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the micro-benchmarks; 1 like the pipeline's actors (Ray sets "
        "OMP_NUM_THREADS to an actor's num_cpus, 1 in the tiny config)",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 5 if args.quick else 14
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.quick:
        args.skip_long = True
        args.no_ray = True
    if args.packing_only:
        args.skip_run = True
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    return args


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def summary_rows(
    pipeline: PipelineResult | None,
    weight_medians: dict[str, float] | None,
    ref_results: list[RefResult],
    train_results: list[TrainResult],
) -> list[list[str]]:
    rows = []
    if pipeline is not None:
        rows += [
            [
                "generated tokens/s (engine / wall)",
                f"{pipeline.generation_rate:,.0f} / {pipeline.generation_wall_rate:,.0f}",
            ],
            [
                "trained tokens/s (trainer / wall)",
                f"{pipeline.train_rate:,.0f} / {pipeline.train_wall_rate:,.0f}",
            ],
            ["trainer time waiting for data", f"{pipeline.waiting_s / pipeline.step_s:.1%}"],
            ["seconds per training step (wall window)", f"{pipeline.seconds_per_step:.3f}"],
        ]
        if pipeline.weight_sync_s and weight_medians is not None:
            clone = weight_medians["clone"]
            sync = statistics.median(pipeline.weight_sync_s)
            rows.append(
                [
                    "weight sync (pipeline time_weight_sync) vs in-memory copy",
                    f"{sync * 1e3:.1f} ms vs {clone * 1e3:.2f} ms = {sync / clone:,.0f}x",
                ]
            )
    if weight_medians is not None:
        engine, clone = weight_medians["engine_receiver"], weight_medians["clone"]
        rows.append(
            [
                "engine update (WeightReceiver) vs in-memory copy",
                f"{engine * 1e3:.1f} ms vs {clone * 1e3:.2f} ms = {engine / clone:,.0f}x",
            ]
        )
    for result in ref_results:
        packed, single = result.seconds["packed (dense mask)"], result.seconds["one at a time"]
        rows.append(
            [
                f"ref logprobs tokens/s, {result.label.split(' (')[0]}: packed / single",
                f"{result.tokens / packed:,.0f} / {result.tokens / single:,.0f} = "
                f"{single / packed:.2f}x",
            ]
        )
        repeated = result.seconds["packed (varlen)"]
        shared = result.seconds["packed (varlen, shared prompts)"]
        rows.append(
            [
                f"ref logprobs (varlen), {result.label.split(' (')[0]}: shared prompts speed-up",
                f"{repeated / shared:.2f}x ({result.shared_tokens / result.tokens:.0%} of the "
                "tokens)",
            ]
        )
    for result in train_results:
        repeated = result.seconds["prompts repeated"]
        shared = result.seconds["shared prompts"]
        rows.append(
            [
                f"train fwd+bwd (varlen), {result.label.split(' (')[0]}: shared prompts speed-up",
                f"{repeated / shared:.2f}x ({result.shared_tokens / result.tokens:.0%} of the "
                "tokens)",
            ]
        )
    return rows


def main() -> None:
    args = parse_args()
    bench_start = time.perf_counter()
    start_load = load_average()
    print(f"Load average at start: {start_load}")
    print(
        "This machine may be shared with other work: the numbers move with its load. "
        "Micro-benchmarks interleave their variants and report medians."
    )
    # Before vLLM starts in this process: its CPU worker disables torch.set_num_threads.
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}; micro-benchmarks use {torch.get_num_threads()} thread(s), "
        "like the pipeline's actors (Ray: OMP_NUM_THREADS = num_cpus = 1)"
    )

    work_dir = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    try:
        model_dir, model_text = resolve_model_dir(args.model_dir, work_dir)
        print(f"Model: {model_text}: {describe_model(model_dir)}")

        pipeline = None
        if not args.skip_run:
            progress(f"running the pipeline: {args.steps} steps of {CONFIG}")
            rows, run_seconds = run_pipeline(
                model_dir, work_dir / "run", args.steps, args.run_timeout
            )
            pipeline = summarize_pipeline(rows, args.steps, args.warmup_steps, run_seconds)
            if args.pipeline_only:
                print_pipeline(pipeline)
                print_breakdown(pipeline)
                return

        # Before the vLLM engine exists in this process, so that its start-up (thread and
        # memory binding) cannot touch these timings.
        progress("reference logprobs: arithmetic-like batch")
        short_batch = synthetic_batch(
            num_prompts=8,
            group_size=8,
            vocab_size=int(load_hf_config(model_dir)["vocab_size"]),
            prompt_range=(10, 20),
            response_len=uniform_lengths(5, 24),
            seed=args.seed,
        )
        short_label = "arithmetic-like (prompts 10-20, responses 5-24, groups of 8)"
        ref_results = [
            bench_ref_logprobs(
                short_label,
                model_dir,
                short_batch,
                budget=2048,  # the config's target_tokens_per_batch
                repeats=args.repeats,
            )
        ]
        progress("training forward + backward: arithmetic-like batch")
        train_results = [bench_train_step(short_label, model_dir, short_batch, 2048, args.repeats)]
        long_repeats = max(2, args.repeats - 2)
        if not args.skip_long:
            progress("reference logprobs: GSM8K-like batch on a larger model")
            long_dir = build_tiny_qwen2(work_dir / "long_qwen2", **LONG_MODEL_SHAPE)
            long_batch = synthetic_batch(
                num_prompts=8,
                group_size=8,
                vocab_size=LONG_MODEL_SHAPE["vocab_size"],
                prompt_range=(80, 250),
                response_len=lognormal_lengths(250, 0.5, 1024),
                seed=args.seed,
            )
            long_label = "GSM8K-like (prompts 80-250, responses log-normal, median 250)"
            ref_results.append(
                bench_ref_logprobs(
                    long_label, long_dir, long_batch, budget=4096, repeats=long_repeats
                )
            )
            progress("training forward + backward: GSM8K-like batch")
            train_results.append(
                bench_train_step(long_label, long_dir, long_batch, 4096, long_repeats)
            )

        weight_medians = None
        if not args.packing_only:
            progress("weight sync: vLLM CPU engine" + ("" if args.no_ray else " and Ray"))
            weight_medians, facts = bench_weight_sync(model_dir, args.repeats, not args.no_ray)

        if pipeline is not None:
            print_pipeline(pipeline)
            print_breakdown(pipeline)
        if weight_medians is not None:
            print_weight_sync(weight_medians, facts, pipeline, args.repeats)
        for index, result in enumerate(ref_results):
            print_ref(result, args.repeats if index == 0 else long_repeats)
        for index, result in enumerate(train_results):
            print_train(result, args.repeats if index == 0 else long_repeats)
        print_table(
            "Summary",
            ["measurement", "value"],
            summary_rows(pipeline, weight_medians, ref_results, train_results),
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"\nLoad average at start: {start_load}")
    print(f"Load average at end:   {load_average()}")
    print(f"Whole benchmark: {time.perf_counter() - bench_start:.0f} s")


if __name__ == "__main__":
    main()
