"""What a run shows on the terminal: a few start lines, one progress bar, the results.

Everything else a run's processes print goes to ``output_dir/logs/`` (`grpo.observability.logs`)
unless ``log_level`` is debug. On a terminal that reports its size the progress is one tqdm bar;
anywhere else (a file, a pipe, a test) a plain line every tenth of the run.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from grpo.config import RunConfig
from grpo.observability.logs import (
    ANSI_CODE,
    DRIVER_LOG,
    is_verbose,
    log_traceback,
    logs_dir,
)
from grpo.observability.metric_logger import (
    DEFAULT_METRIC_LOGGER,
    resolve_wandb_mode,
    saved_wandb_run,
)
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    GROUPS_KEPT,
    GROUPS_SCORED,
    REWARDS_MEAN,
    TRAIN_LOSS,
)
from grpo.run_folder import CHECKPOINTS_DIR, LATEST_FILE, latest_checkpoint_text


def progress_fields(state: Any) -> dict[str, str]:
    """What the progress line shows after a step: policy version, reward, loss, accuracy.

    ``state`` is the run's `grpo.orchestrator.RunState`. When dynamic sampling dropped groups
    during the step, ``kept`` shows how many of the groups scored reached the buffer.
    """
    fields = {"v": str(state.policy_version)}
    reward = state.last_scored_metrics.get(REWARDS_MEAN)
    if reward is not None:
        fields["reward"] = f"{reward:.3f}"
    scored = state.last_metrics.get(GROUPS_SCORED)
    kept = state.last_metrics.get(GROUPS_KEPT)
    if scored and kept is not None and kept < scored:
        fields["kept"] = f"{kept:.0f}/{scored:.0f}"
    loss = state.last_metrics.get(TRAIN_LOSS)
    if loss is not None:
        fields["loss"] = f"{loss:.4f}"
    if state.eval_history:
        fields["eval_acc"] = f"{state.eval_history[-1][1][EVAL_ACCURACY]:.3f}"
    return fields


def _has_sized_terminal() -> bool:
    """Whether stdout is a terminal that reports its size.

    A pseudo-terminal without one (0 columns or rows, as some containers and ``script`` give)
    makes tqdm draw nothing at all.
    """
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, ValueError):
        return False
    return sys.stdout.isatty() and size.columns > 0 and size.lines > 0


@contextmanager
def progress_bar(num_steps: int, state: Any):
    """Progress over training steps; yields ``on_step(state)``, called after each step.

    On a terminal that reports its size: one tqdm bar (rate, ETA and `progress_fields`).
    Anywhere else (a file, a pipe, a test capturing stdout), where a bar's carriage returns
    would pile up: a plain line every tenth of the run and at its last step.
    """
    interactive = _has_sized_terminal()
    every = max(1, num_steps // 10)
    first_step, started = state.step, time.monotonic()
    with tqdm(
        total=num_steps,
        initial=state.step,
        desc="GRPO",
        unit="step",
        file=sys.stdout,
        disable=not interactive,
        dynamic_ncols=True,
    ) as bar:

        def on_step(state: Any) -> None:
            fields = progress_fields(state)
            if interactive:
                bar.set_postfix(fields, refresh=False)
                bar.update(1)
                return
            if state.step % every and state.step != num_steps:
                return
            elapsed = time.monotonic() - started
            remaining = elapsed / max(state.step - first_step, 1) * (num_steps - state.step)
            shown = " ".join(f"{key}={value}" for key, value in fields.items())
            print(
                f"step {state.step}/{num_steps} {shown} "
                f"elapsed={tqdm.format_interval(elapsed)} eta={tqdm.format_interval(remaining)}",
                flush=True,
            )

        yield on_step


def wandb_text(cfg: RunConfig, run_dir: Path) -> str | None:
    """How the run logs to W&B, for the start lines; None for a metric logger of your own."""
    node = cfg.metric_logger
    if node.get("_component_", DEFAULT_METRIC_LOGGER) != DEFAULT_METRIC_LOGGER:
        return None
    try:
        mode = resolve_wandb_mode(node.get("mode", "online"))
    except ValueError as error:
        return str(error)
    if node.get("use_wandb") is False or mode == "disabled":
        return "off"
    project = node.get("project", "grpo")
    saved = saved_wandb_run(node.get("log_dir") or run_dir, project)
    # A resume goes on in the W&B run its run folder names (`MetricLogger`).
    run = f", run {saved['id']} resumed" if cfg.resume_from_checkpoint and saved else ""
    if mode == "offline":
        return (
            f"offline, project {project!r}{run}, in {run_dir / 'wandb'} (upload with `wandb sync`)"
        )
    return f"online, project {project!r}{run}"


def dataset_text(node: dict[str, Any], dataset: Any) -> str:
    """``grpo.data.prompt_dataset(/data/train.jsonl), 7473 rows``: what a dataset was built from."""
    source = node.get("source") or node.get("taskset")  # a verifiers environment's tasks
    origin = f"{node['_component_']}({source})" if source else node["_component_"]
    return f"{origin}, {len(dataset)} rows"


def print_start(cfg: RunConfig, run_dir: Path, datasets: dict[str, Any]) -> None:
    """The lines before the progress bar: what runs, on which data, where its files go."""
    orchestration = cfg.orchestration
    print(
        f"GRPO: {cfg.base_model_path}, {orchestration.num_steps} steps, "
        f"actors: {orchestration.num_inference_workers} inference, "
        f"{orchestration.num_ref_workers} ref, {orchestration.num_training_workers} training"
    )
    for key, dataset in datasets.items():
        node = getattr(cfg, key) or cfg.environment  # no dataset: the environment's tasks
        print(f"Data: {key} {dataset_text(node, dataset)}")
    print(f"Run folder: {run_dir}")
    if not is_verbose(cfg.log_level):
        print(
            f"Logs: {logs_dir(run_dir)}/ (vLLM, Ray, W&B; --verbose or log_level=debug "
            "prints them here instead)"
        )
    wandb = wandb_text(cfg, run_dir)
    if wandb:
        print(f"W&B: {wandb}")
    sys.stdout.flush()


def write_plots(run_dir: Path) -> list[str]:
    """Plots of the run's metrics; a failure is reported, never fatal to a finished run."""
    try:
        from grpo.observability.plotting import plot_run

        return [str(p) for p in plot_run(run_dir)]
    except Exception as error:  # plots are a convenience; never fail a finished run on them
        print(f"could not write plots: {error}", file=sys.stderr)
        return []


def print_end(summary: dict) -> None:
    """The lines after the progress bar: what ran, accuracy, where the policy, metrics and
    plots are.

    Args:
        summary (dict): The recipe's summary: ``steps`` (the last step), ``seconds`` (of this
            invocation), ``policy_version``, ``eval`` (``(step, accuracy)`` pairs, oldest
            first), ``final_checkpoint``, ``run_dir``, ``plots``; for a resumed run
            ``resumed_at_step`` (the checkpoint's step) and ``evals_before_resume`` (how many
            of ``eval`` its checkpoint held), so that what this invocation ran is told apart
            from what ran before.
    """
    steps, resumed_at = summary["steps"], summary.get("resumed_at_step")
    took = tqdm.format_interval(summary["seconds"])
    if resumed_at is None:
        ran = f"{steps} steps"
    else:
        this_run = steps - resumed_at
        ran = (
            f"step {steps} ({this_run} step{'' if this_run == 1 else 's'} this run, resumed "
            f"from step {resumed_at})"
        )
    print(f"Run finished: {ran} in {took}, policy version {summary['policy_version']}")
    before = summary.get("evals_before_resume", 0) if resumed_at is not None else 0
    older, newer = (
        [f"{a:.3f} at step {step}" for step, a in part if a is not None]
        for part in (summary["eval"][:before], summary["eval"][before:])
    )
    if older and newer:
        accuracies = f"{' -> '.join(older)} (before this run's resume) -> {' -> '.join(newer)}"
    elif older:
        accuracies = f"{' -> '.join(older)}, before this run's resume"
    else:
        accuracies = " -> ".join(newer)
    if accuracies:
        print(f"Held-out accuracy: {accuracies}")
    print(f"Final policy: {summary['final_checkpoint']}")
    run_dir = Path(summary["run_dir"])
    plots = summary["plots"]
    where_plots = f"; plots: {Path(plots[0]).parent}/ ({len(plots)} PNG)" if plots else ""
    print(f"Metrics: {run_dir / 'metrics.jsonl'}{where_plots}")


def stop_reason(error: BaseException) -> str:
    """What stopped a run, in one line.

    A stop the run decided on (`grpo.errors`: an actor that failed, a diverged loss, an
    environment failing its episodes) is its message; any other error is named by its type.
    A message of several lines (an actor's remote traceback) gives its first line and, where
    the first does not already hold it, its last: a traceback states its cause last. No colour
    codes.
    """
    lines = [line.strip() for line in ANSI_CODE.sub("", str(error)).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] not in text:
        text = f"{text} ... {lines[-1]}"
    if type(error).__module__ != "grpo.errors":
        name = type(error).__qualname__
        if type(error).__module__ != "builtins":
            name = f"{type(error).__module__}.{name}"
        text = f"{name}: {text}" if text else name
    return text


def print_stopped(error: BaseException, run_dir: str | Path, log_level: str = "info") -> str:
    """Say on the terminal that a run stopped on an error; keep its traceback in driver.log.

    Three lines on stderr: what stopped it (`stop_reason`), the log file that holds the
    traceback (and the folder of each process's output), and the checkpoint to resume from.

    Args:
        log_level (str): The run's ``log_level`` (with debug, the processes' output is on the
            terminal, not in files).

    Returns:
        str: The first line's reason.
    """
    run_dir = Path(run_dir).expanduser().resolve()
    reason = stop_reason(error)
    log_traceback(error, f"run stopped: {reason}")
    where = logs_dir(run_dir)
    outputs = "" if is_verbose(log_level) else f" (each process's output: {where}/)"
    resume = latest_checkpoint_text(run_dir)
    if (run_dir / CHECKPOINTS_DIR / LATEST_FILE).is_file():
        resume = f"{resume} (resume_from_checkpoint=true)"
    print(f"Run stopped: {reason}", file=sys.stderr)
    print(f"Traceback: {where / DRIVER_LOG}{outputs}", file=sys.stderr)
    print(f"Resume from: {resume}", file=sys.stderr, flush=True)
    return reason
