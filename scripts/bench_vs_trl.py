"""Side-by-side benchmark: this project against TRL's ``GRPOTrainer`` on the demo workload.

Both frameworks train the shipped demo model (``assets/tiny_arithmetic_qwen2``) on the same job,
taken from ``configs/tiny_arithmetic_cpu.yaml`` with `WORKLOAD_OVERRIDES` (batch 64, no dynamic
sampling, a half-cosine schedule, whatever the demo uses): the arithmetic train split with the
``answer_only`` prompt (question + newline, raw text, no chat template), the config's reward
functions summed with weight 1 (math-verify correctness +
``FormatReward(think_required=False)``), 8 prompts x 8 samples per step, at most 24 new tokens,
temperature 1.0, top-p 1.0, AdamW with the config's lr / betas / weight decay, the same warm-up
+ cosine schedule, gradient clipping at 1.0, clip epsilon 0.2 / 0.28, no KL (``beta=0.0``), one
epoch per batch, fp32, CPU.

* **this project** runs the way a user runs it: ``grpo run async_grpo --config
  tiny_arithmetic_cpu`` with overrides (steps, ``eval_every_n_steps=null``, ``output_dir``) in a
  child process, once asynchronously (the default) and once with
  ``orchestration.synchronous=true`` (lock-step, like TRL). Per-step times come from the log
  times of the training steps in its ``metrics.jsonl``; completion tokens from
  ``train_actor_training/response_lengths``. The final policy is the run's ``final/`` folder.
* **TRL** runs ``GRPOTrainer`` in a child process (this script with ``--trl-child``) with plain
  Hugging Face ``generate`` (no vLLM) on the CPU: ``per_device_train_batch_size=64``,
  ``num_generations=8``, ``loss_type="dapo"``. ``"dapo"`` divides the summed token losses by the
  number of completion tokens in the whole (accumulated) batch, which is our ``token_mean``
  (``"bnpo"`` would too here, with one process and no accumulation; ``"grpo"`` is
  ``seq_mean_token_mean``, ``"dr_grpo"`` is ``seq_mean_token_sum_norm``). Step times come from a
  ``TrainerCallback`` (``on_step_end``), completion tokens from ``completions/mean_length``. The
  final policy is saved with ``trainer.save_model``. Two differences remain: TRL's ``generate``
  stops at EOS only, while our collector also stops at the template's ``</answer>`` (the demo
  model emits EOS right after it), and TRL computes rewards in-process where ours uses a worker
  pool with a timeout.

Threads: Ray gives each of our actors one torch thread (``OMP_NUM_THREADS=1``), and the TRL
process runs with torch's default thread count, as TRL's users run it; ``--trl-threads N``
sets it (on a busy 2-core machine two OpenMP threads per process can make TRL's generate and
backward much slower, their barriers spinning while the cores are taken).

Steady state excludes the first ``--warmup-steps`` steps (default 5): seconds per step is the
wall time from the end of step ``warmup`` to the end of the last step divided by the number of
steps in between (the median of the per-step times is printed too); completion tokens/s is the
completion tokens of those steps over the same window. "first step" is the time from launching
the child process to the end of step 1 (imports, Ray / vLLM or model start-up, first batch).

Accuracy is measured by ONE evaluator, in this process, for the initial model and both final
policies: each HF folder is loaded with `grpo.models.build_model`, the config's held-out
``eval_dataset`` (512 test-split questions) is greedy-decoded (same tokenizer and prompt ids as
the collector, at most 24 new tokens, cut after the first ``</answer>`` like the collector's stop
string) and scored with ``MathCorrectnessReward``. 512 questions give about +-2 points of noise.

The runs go one after another (the machine may be shared: compare ratios, not absolute times),
in the order ``--order`` gives; the load average is printed at the start and the end, and the
table's last column is the 5-minute load average when each run ended.

TRL is an optional dependency:
    pip install -e ".[bench]"          # or: .venv/bin/pip install trl==1.16.0

Usage:
    python scripts/bench_vs_trl.py                 # 60 steps each, about 15 min on 2 cores
    python scripts/bench_vs_trl.py --steps 30      # shorter check
    python scripts/bench_vs_trl.py --no-sync       # skip the synchronous run of this project
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import load_average, print_table

CONFIG = "tiny_arithmetic_cpu"
# The benchmark's workload, where the demo config has moved on: 8 prompts x 8 samples per step,
# every group trained (TRL has no dynamic sampling) and a plain half-cosine schedule (TRL's
# "cosine"). Both frameworks read the config through these overrides.
WORKLOAD_OVERRIDES = [
    "training.batch_size=64",
    "ref.filter_zero_variance_groups=false",
    "training.lr_scheduler.num_cycles=0.5",
]
TARGET_SPEEDUP = 1.5
STARTUP_ATTEMPTS = 3  # launches of our run when Ray's start-up times out
TRL_VERSION = "1.16.0"
INSTALL_HINT = f'pip install -e ".[bench]"  (or: .venv/bin/pip install trl=={TRL_VERSION})'


# ------------------------------------------------------------------ steady-state statistic


@dataclass
class SteadyState:
    """Throughput of a run from the wall-clock end times of its steps."""

    measured_steps: int
    window_s: float
    seconds_per_step: float
    median_step_s: float
    completion_tokens: float
    tokens_per_s: float


def steady_state(
    step_end_times: list[float], step_tokens: list[float], warmup_steps: int
) -> SteadyState:
    """Seconds per step and completion tokens/s after the first ``warmup_steps`` steps.

    ``step_end_times[i]`` is the wall-clock time step ``i + 1`` ended and ``step_tokens[i]`` the
    completion tokens it trained on. The window runs from the end of step ``warmup_steps`` to the
    end of the last step, so it holds steps ``warmup_steps + 1 ..`` whole, and their time
    includes everything between optimizer steps (generation, scoring, waiting, weight sync).

    Raises:
        ValueError: If the lists differ in length, times go backwards, or no step is left
            after the warm-up.

    Example:
        >>> s = steady_state([10.0, 11.0, 13.0, 14.0], [100, 100, 80, 120], warmup_steps=1)
        >>> s.seconds_per_step, s.median_step_s, s.tokens_per_s
        (1.3333333333333333, 1.0, 75.0)
    """
    if len(step_end_times) != len(step_tokens):
        raise ValueError(f"{len(step_end_times)} step times but {len(step_tokens)} token counts")
    if warmup_steps < 1:
        raise ValueError(
            f"warmup_steps must be >= 1 (the window starts at a step's end), got {warmup_steps}"
        )
    if len(step_end_times) <= warmup_steps:
        raise ValueError(
            f"{len(step_end_times)} steps logged; need more than warmup_steps={warmup_steps}"
        )
    durations = [b - a for a, b in zip(step_end_times, step_end_times[1:])]
    if any(d < 0 for d in durations):
        raise ValueError("step end times must not decrease")
    measured = durations[warmup_steps - 1 :]
    window = step_end_times[-1] - step_end_times[warmup_steps - 1]
    tokens = float(sum(step_tokens[warmup_steps:]))
    return SteadyState(
        measured_steps=len(measured),
        window_s=window,
        seconds_per_step=window / len(measured),
        median_step_s=statistics.median(measured),
        completion_tokens=tokens,
        tokens_per_s=tokens / window if window > 0 else float("nan"),
    )


# ------------------------------------------------------------------------- the runs


@dataclass
class RunResult:
    name: str
    launched: float  # time.time() when the child process started
    wall_s: float
    step_end_times: list[float]
    step_tokens: list[float]
    step_rewards: list[float]
    final_dir: Path
    log_path: Path
    state: SteadyState | None = None
    accuracy: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first_step_s(self) -> float:
        return self.step_end_times[0] - self.launched


def run_child(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> float:
    """Run ``command`` with output to ``log_path``; return its wall seconds.

    Raises:
        RuntimeError: If it fails or times out (with the log's tail).
    """
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run(
                command,
                cwd=_repo_root(),
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


def _repo_root() -> Path:
    from grpo.config import repo_root

    return repo_root()


def run_ours(
    name: str, out_dir: Path, steps: int, synchronous: bool, timeout_s: float
) -> RunResult:
    """``grpo run async_grpo --config tiny_arithmetic_cpu`` with overrides, in a child process."""
    overrides = [
        *WORKLOAD_OVERRIDES,
        f"output_dir={out_dir}",
        f"orchestration.num_steps={steps}",
        "eval_every_n_steps=null",  # accuracy is measured afterwards, by one evaluator for all
        f"orchestration.synchronous={str(synchronous).lower()}",
    ]
    command = [
        sys.executable,
        "-c",
        "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))",
        *["run", "async_grpo", "--config", CONFIG, *overrides],
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    log_path = out_dir.parent / f"{out_dir.name}.log"
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        launched = time.time()
        try:
            wall = run_child(command, log_path, timeout_s, env)
            break
        except RuntimeError as error:
            # An overloaded machine can time Ray's own start-up out; that is not a result.
            if "timed out during startup" not in str(error) or attempt == STARTUP_ATTEMPTS:
                raise
            print(f"  Ray start-up timed out (attempt {attempt}); retrying", flush=True)
            shutil.rmtree(out_dir, ignore_errors=True)
    rows = [
        json.loads(line)
        for line in (out_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    perf = "train_actor_performance/total_step_time (s)"
    train_rows = sorted((r for r in rows if perf in r), key=lambda r: r["step"])
    batch = _load_cfg().training.batch_size
    reward_key = "ref_actor_rewards/rewards_mean"  # one row per scored batch
    reward_rows = sorted((r for r in rows if reward_key in r), key=lambda r: r["time"])
    return RunResult(
        name=name,
        launched=launched,
        wall_s=wall,
        step_end_times=[r["time"] for r in train_rows],
        step_tokens=[r["train_actor_training/response_lengths"] * batch for r in train_rows],
        step_rewards=[r[reward_key] for r in reward_rows],
        final_dir=out_dir / "final",
        log_path=log_path,
    )


def run_trl(out_dir: Path, steps: int, threads: int | None, timeout_s: float) -> RunResult:
    """TRL's GRPOTrainer in a child process (this script with ``--trl-child``); ``threads``
    None leaves torch's thread count at its default, as TRL's users get it."""
    command = [*[sys.executable, __file__, "--trl-child", str(out_dir)], "--steps", str(steps)]
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_NUM_THREADS", None)  # inherited from a caller, it would not be the default
    if threads is not None:
        command += ["--trl-threads", str(threads)]
        env["OMP_NUM_THREADS"] = str(threads)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    launched = time.time()
    wall = run_child(command, log_path, timeout_s, env)
    timing = json.loads((out_dir / "timing.json").read_text())
    return RunResult(
        name="TRL GRPOTrainer (HF generate)",
        launched=launched,
        wall_s=wall,
        step_end_times=timing["step_end_times"],
        step_tokens=timing["step_tokens"],
        step_rewards=timing["step_rewards"],
        final_dir=out_dir / "final",
        log_path=log_path,
    )


def _load_cfg():
    from grpo.config import load_config

    return load_config(CONFIG, WORKLOAD_OVERRIDES)


# ------------------------------------------------------------------------ TRL child


def trl_child(out_dir: Path, steps: int, threads: int | None) -> None:
    """Train with TRL's GRPOTrainer on the demo workload; write timing.json and final/."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.config import instantiate

    cfg = _load_cfg()
    model_dir = str(cfg.base_model_path)
    train_set = instantiate(cfg.dataset)
    rows = [
        {"prompt": train_set[i]["prompt"], "answer": train_set[i]["answer"]}
        for i in range(len(train_set))
    ]
    dataset = Dataset.from_list(rows)
    reward_fns = [instantiate(node) for node in cfg.reward_functions]

    def trl_reward(fn):
        def reward(prompts, completions, answer, **kwargs):
            return [fn(completion, gold).reward for completion, gold in zip(completions, answer)]

        reward.__name__ = fn.name
        return reward

    weights = cfg.ref.reward_weights
    optimizer = cfg.training.optimizer
    loss = cfg.training.loss
    if float(loss["kl_coeff"]) != 0.0 or loss["aggregation"] != "token_mean":
        raise ValueError("the TRL mapping assumes kl_coeff=0 and aggregation=token_mean")
    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=int(cfg.training.batch_size),
        gradient_accumulation_steps=1,
        num_generations=int(cfg.inference.group_size),
        max_completion_length=int(cfg.inference.max_generated_tokens),
        temperature=float(cfg.inference.temperature),
        top_p=float(cfg.inference.top_p),
        num_iterations=int(cfg.training.ppo_epochs),
        learning_rate=float(optimizer["lr"]),
        adam_beta1=float(optimizer["betas"][0]),
        adam_beta2=float(optimizer["betas"][1]),
        weight_decay=float(optimizer["weight_decay"]),
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=int(cfg.training.lr_scheduler["num_warmup_steps"]),
        max_grad_norm=float(cfg.training.clip_grad_norm),
        beta=0.0,
        epsilon=float(loss["epsilon_low"]),
        epsilon_high=float(loss["epsilon_high"]),
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=list(weights) if weights is not None else None,
        seed=int(cfg.seed),
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    timing: dict[str, list[float]] = {"step_end_times": [], "step_tokens": [], "step_rewards": []}

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            timing["step_end_times"].append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "completions/mean_length" in logs:
                timing["step_tokens"].append(
                    float(logs["completions/mean_length"]) * int(cfg.training.batch_size)
                )
                timing["step_rewards"].append(float(logs.get("reward", float("nan"))))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(fn) for fn in reward_fns],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    (out_dir / "timing.json").write_text(json.dumps(timing))


# ------------------------------------------------------------------------ evaluation


def greedy_accuracy(
    model_dir: Path, eval_items: list[dict[str, Any]], max_new_tokens: int
) -> float:
    """Greedy held-out accuracy of an HF folder, the same code path for every policy.

    The torchtune model from `grpo.models.build_model`, the demo tokenizer, prompt ids encoded
    as the collector encodes them; prompts grouped by length (no padding), no KV cache (the
    sequences are ~30 tokens). Completions are decoded without special tokens and cut after the
    first ``</answer>`` (the collector's stop string), then scored by ``MathCorrectnessReward``.
    """
    import torch

    from grpo.models import build_model, load_tokenizer
    from grpo.rewards import MathCorrectnessReward

    cfg = _load_cfg()
    tokenizer = load_tokenizer(cfg.base_model_path)
    model = build_model(model_dir).eval()
    stop_ids = torch.tensor(sorted(tokenizer.stop_tokens))
    prompts = [
        tokenizer.encode(item["prompt"], add_bos=False, add_eos=False) for item in eval_items
    ]
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    completions = [""] * len(prompts)
    with torch.no_grad():
        for indices in by_length.values():
            tokens = torch.tensor([prompts[i] for i in indices])
            prompt_length = tokens.shape[1]
            finished = torch.zeros(len(indices), dtype=torch.bool)
            for _ in range(max_new_tokens):
                next_ids = model(tokens)[:, -1].argmax(dim=-1)
                next_ids = torch.where(finished, stop_ids[0], next_ids)
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
                finished |= torch.isin(next_ids, stop_ids)
                if finished.all():
                    break
            for row, index in enumerate(indices):
                response = tokens[row, prompt_length:].tolist()
                stops = [t for t, token in enumerate(response) if token in tokenizer.stop_tokens]
                response = response[: stops[0]] if stops else response
                text = tokenizer.decode(response, skip_special_tokens=True)
                end = text.find("</answer>")
                completions[index] = text if end < 0 else text[: end + len("</answer>")]
    reward = MathCorrectnessReward(partial_credit=0.0)
    correct = [reward(c, item["answer"]).success for c, item in zip(completions, eval_items)]
    return sum(correct) / len(correct)


# ------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="steps left out of the steady state"
    )
    parser.add_argument("--no-sync", action="store_true", help="skip our synchronous run")
    parser.add_argument(
        "--order",
        default="trl,async,sync",
        help="run order, a comma-separated subset of trl,async,sync",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--keep", type=Path, default=None, help="keep run folders here")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of the TRL process; default: torch's own default, as TRL's users "
        "run it (each of our Ray actors gets 1)",
    )
    parser.add_argument("--trl-child", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    # Here, not at import: the tests import this script, and the setting would leak into the
    # runs they start.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    args = parse_args()
    if importlib.util.find_spec("trl") is None:
        sys.exit(f"bench_vs_trl.py needs TRL, an optional dependency: {INSTALL_HINT}")
    if args.trl_child is not None:
        args.trl_child.mkdir(parents=True, exist_ok=True)
        trl_child(args.trl_child, args.steps, args.trl_threads)
        return
    if args.steps <= args.warmup_steps:
        sys.exit(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")

    import torch
    import trl

    from grpo.config import instantiate

    torch.set_num_threads(1)  # the evaluation; oversubscribed threads crawl on a shared machine
    cfg = _load_cfg()
    print(f"load average at start: {load_average()}")
    print(
        f"torch {torch.__version__}, trl {trl.__version__}; model {cfg.base_model_path}; "
        "TRL process: "
        + (
            f"{args.trl_threads} torch thread(s)"
            if args.trl_threads is not None
            else f"torch's default threads ({os.cpu_count()} cores)"
        )
    )
    print(
        f"workload: {args.steps} steps x {cfg.inference.batch_size} prompts x "
        f"{cfg.inference.group_size} samples, <= {cfg.inference.max_generated_tokens} new tokens, "
        f"lr {cfg.training.optimizer['lr']}, eps {cfg.training.loss['epsilon_low']}/"
        f"{cfg.training.loss['epsilon_high']}, no KL, token-mean loss (TRL loss_type='dapo')"
    )
    order = [name.strip() for name in args.order.split(",") if name.strip()]
    if args.no_sync:
        order = [name for name in order if name != "sync"]
    unknown = set(order) - {"trl", "async", "sync"}
    if unknown or "trl" not in order or "async" not in order:
        sys.exit(f"--order must list trl and async (and optionally sync), got {args.order!r}")

    work_dir = Path(args.keep or tempfile.mkdtemp(prefix="bench_vs_trl_")).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, RunResult] = {}
    try:
        for name in order:
            print(
                f"running {name} ({args.steps} steps; log in {work_dir / name}.log) ...", flush=True
            )
            if name == "trl":
                results[name] = run_trl(
                    work_dir / "trl", args.steps, args.trl_threads, args.timeout
                )
            else:
                label = "this project, " + ("synchronous" if name == "sync" else "async (default)")
                results[name] = run_ours(
                    label, work_dir / name, args.steps, name == "sync", args.timeout
                )
            results[name].extra["load"] = os.getloadavg()[1]  # 5-minute average, at the end
            print(f"  done in {results[name].wall_s:.0f} s", flush=True)
        for result in results.values():
            result.state = steady_state(
                result.step_end_times, result.step_tokens, args.warmup_steps
            )

        eval_items = [dict(item) for item in instantiate(cfg.eval_dataset)]
        budget = int(cfg.inference.max_generated_tokens)
        print(f"evaluating {len(eval_items)} held-out questions greedily ...", flush=True)
        initial = greedy_accuracy(Path(cfg.base_model_path), eval_items, budget)
        for result in results.values():
            result.accuracy = greedy_accuracy(result.final_dir, eval_items, budget)
    finally:
        if args.keep is None:
            shutil.rmtree(work_dir, ignore_errors=True)

    trl_result = results["trl"]
    rows = []
    for name in ["trl", "async", "sync"]:
        if name not in results:
            continue
        r = results[name]
        s = r.state
        tail = [x for x in r.step_rewards[-10:] if x == x]
        rows.append(
            [
                r.name,
                f"{s.seconds_per_step:.3f}",
                f"{s.median_step_s:.3f}",
                f"{1 / s.seconds_per_step:.2f}",
                f"{s.tokens_per_s:,.0f}",
                f"{r.first_step_s:.1f}",
                f"{r.wall_s:.1f}",
                f"{statistics.mean(tail):.3f}" if tail else "n/a",
                f"{100 * r.accuracy:.1f}%",
                f"{trl_result.state.seconds_per_step / s.seconds_per_step:.2f}x",
                f"{r.extra['load']:.1f}",
            ]
        )
    print_table(
        f"{args.steps} steps each; steady state = steps {args.warmup_steps + 1}-{args.steps}. "
        f"Held-out greedy accuracy on {len(eval_items)} test-split questions, one evaluator; "
        f"initial model: {100 * initial:.1f}%",
        [
            "framework",
            "s/step",
            "median s/step",
            "steps/s",
            "compl. tok/s",
            "first step (s)",
            "total wall (s)",
            "train reward (last 10)",
            "accuracy",
            "steps/s vs TRL",
            "load (5 min)",
        ],
        rows,
    )
    print(f"\nload average at end: {load_average()}")
    ours = results["async"]
    speedup = trl_result.state.seconds_per_step / ours.state.seconds_per_step
    accuracy_ok = ours.accuracy >= trl_result.accuracy
    verdict = "met" if speedup >= TARGET_SPEEDUP and accuracy_ok else "MISSED"
    print(
        f"target (>= {TARGET_SPEEDUP}x TRL's steps/s at equal or better accuracy): {verdict}: "
        f"{speedup:.2f}x, accuracy {100 * ours.accuracy:.1f}% vs TRL {100 * trl_result.accuracy:.1f}% "
        f"(+-2 points of evaluation noise)"
    )
    if "sync" in results:
        sync = results["sync"]
        print(
            f"synchronous mode: {trl_result.state.seconds_per_step / sync.state.seconds_per_step:.2f}x "
            f"TRL's steps/s, accuracy {100 * sync.accuracy:.1f}%"
        )


if __name__ == "__main__":
    main()
