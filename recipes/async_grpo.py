"""Asynchronous GRPO on Ray.

    grpo run async_grpo --config tiny_arithmetic_cpu
    grpo run async_grpo --config qwen2_5_1_5b_gsm8k training.optimizer.lr=5e-7
    python recipes/async_grpo.py --config tiny_arithmetic_cpu orchestration.num_steps=10

The whole run, in order (each stage is a paragraph of `recipe_main`):

1. Config and data: the config arrives validated (``grpo run`` and ``python recipes/...``
   validate it before calling `recipe_main`); the datasets are built once, here, and the
   training set is shared by every collector.
2. Start the actors: metric logger, rollout queue, replay buffer, trainers (FSDP2 when there
   are several), reference actors, and vLLM collectors; from a checkpoint's weights if one
   is resumed.
3. Restore the rest of the checkpoint: step, policy version, held and buffered groups.
4. The loop: collectors generate groups onto the queue; reference actors score them into the
   buffer; trainers sample batches, pack and step; every `weight_sync.every_n_steps` steps
   the new weights go to every collector. Held-out accuracy is measured before the first
   step, every `eval_every_n_steps`, and at the end.
5. Checkpoint: every `checkpoint.save_every_n_steps` inside the loop, and here when a signal stopped it.
6. Verify that the collectors hold the trainer's weights, save the final policy as an
   HF-format folder (loads in vLLM and torchtune), shut every actor down, write plots.

The terminal shows a few lines at the start, one progress bar, and the results; every process's
own output goes to ``output_dir/logs/`` unless ``log_level`` is debug (see `grpo.logs`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from grpo.config import RunConfig, instantiate, run_recipe_cli
from grpo.evaluation import HeldOutEvaluator
from grpo.logs import is_verbose, logs_dir
from grpo.models import load_tokenizer
from grpo.orchestrator import (
    ActorFailedError,
    NoInformativeGroupsError,
    Orchestrator,
    RunState,
    TrainingDivergedError,
    find_checkpoint,
    init_ray,
)
from grpo.orchestrator.metrics import GROUPS_KEPT, GROUPS_SCORED
from grpo.orchestrator.supervisor import DEFAULT_METRIC_LOGGER
from grpo.workers.metric_logger import resolve_wandb_mode


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create the run folder and store the resolved config in it."""
    run_dir = Path(cfg.output_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return run_dir


def build_datasets(cfg: RunConfig) -> dict[str, Any]:
    """Build ``dataset`` and ``eval_dataset`` once: report skipped rows, fail on an empty set.

    Returns:
        dict[str, Any]: The built datasets by config key (absent keys left out).

    Raises:
        ValueError: If a dataset has no usable example.
    """
    datasets = {}
    for key in ("dataset", "eval_dataset"):
        node = getattr(cfg, key)
        if node is None:
            continue
        dataset = datasets[key] = instantiate(node, _key_=key)
        if len(dataset) == 0:
            raise ValueError(f"{key}: no usable examples")
        skipped = getattr(dataset, "skipped", None)
        if skipped is not None and skipped.count:
            print(f"{key}: {skipped.summary()}", file=sys.stderr)
    return datasets


def build_evaluator(cfg: RunConfig, eval_dataset: Any, run: Orchestrator) -> Any:
    """Held-out evaluation on the first ``eval_num_examples`` examples, or None if off.

    Returns:
        Callable | None: ``evaluate(step) -> metrics``, generating with the current first
        collector (a dead one is replaced).
    """
    if eval_dataset is None or not cfg.eval_every_n_steps:
        return None
    limit = min(cfg.eval_num_examples or len(eval_dataset), len(eval_dataset))
    evaluator = HeldOutEvaluator(
        [eval_dataset[i] for i in range(limit)],
        run.collectors[0],
        run.metric_logger,
        max_generated_tokens=cfg.inference.max_generated_tokens,
        reward_timeout_s=cfg.reward_timeout_s,
    )
    return lambda step: evaluator(step, run.collectors[0])


@contextmanager
def stop_on_signals(run: Orchestrator):
    """Ctrl-C / SIGTERM: finish the current step, save a checkpoint, end every actor."""
    previous = {
        sig: signal.signal(sig, lambda *_: run.request_stop())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def progress_fields(state: RunState) -> dict[str, str]:
    """What the progress line shows after a step: policy version, reward, loss, accuracy.

    The reward is that of the groups scored most recently, the loss the last step's, the
    accuracy the last held-out evaluation's. When dynamic sampling dropped groups during the
    step, ``kept`` shows how many of the groups scored reached the buffer.
    """
    fields = {"v": str(state.policy_version)}
    reward = state.last_scored_metrics.get("ref_actor_rewards/rewards_mean")
    if reward is not None:
        fields["reward"] = f"{reward:.3f}"
    scored = state.last_metrics.get(GROUPS_SCORED)
    kept = state.last_metrics.get(GROUPS_KEPT)
    if scored and kept is not None and kept < scored:
        fields["kept"] = f"{kept:.0f}/{scored:.0f}"
    loss = state.last_metrics.get("train_actor_training/loss")
    if loss is not None:
        fields["loss"] = f"{loss:.4f}"
    if state.eval_history:
        fields["eval_acc"] = f"{state.eval_history[-1][1]['eval/accuracy']:.3f}"
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
def progress_bar(num_steps: int, state: RunState):
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

        def on_step(state: RunState) -> None:
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
    if mode == "offline":
        return f"offline, project {project!r}, in {run_dir / 'wandb'} (upload with `wandb sync`)"
    return f"online, project {project!r}"


def dataset_text(node: dict[str, Any], dataset: Any) -> str:
    """``grpo.data.prompt_dataset(/data/train.jsonl), 7473 rows``: what a dataset was built from."""
    source = node.get("source")
    origin = f"{node['_component_']}({source})" if source else node["_component_"]
    return f"{origin}, {len(dataset)} rows"


def print_start(cfg: RunConfig, run_dir: Path, datasets: dict[str, Any]) -> None:
    """The lines before the progress bar: what runs, on which data, where its files go."""
    orchestration = cfg.orchestration
    print(
        f"GRPO: {cfg.base_model_path}, {orchestration.num_steps} steps, "
        f"{orchestration.num_inference_workers} collector(s), "
        f"{orchestration.num_ref_workers} reference actor(s), "
        f"{orchestration.num_training_workers} trainer(s)"
    )
    for key, dataset in datasets.items():
        print(f"Data: {key} {dataset_text(getattr(cfg, key), dataset)}")
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
        from grpo.plotting import plot_run

        return [str(p) for p in plot_run(run_dir)]
    except Exception as error:  # plots are a convenience; never fail a finished run on them
        print(f"could not write plots: {error}", file=sys.stderr)
        return []


def recipe_main(cfg: RunConfig) -> dict:
    """Run asynchronous GRPO as the config says.

    Args:
        cfg (RunConfig): A validated run config (see ``configs/``).

    Returns:
        dict: Final step, policy version, held-out accuracy history and output paths.
    """
    # 1. Config and data (the config was validated by the caller).
    datasets = build_datasets(cfg)
    run_dir = prepare_run_dir(cfg)
    print_start(cfg, run_dir, datasets)
    init_ray(cfg)
    tokenizer = load_tokenizer(cfg.base_model_path)
    checkpoint = find_checkpoint(run_dir, cfg.resume_from_checkpoint)
    run = Orchestrator(cfg, run_dir, tokenizer, dataset=datasets["dataset"])
    with stop_on_signals(run):
        try:
            # 2. Start the actors (trainers and collectors from the checkpoint's weights).
            run.start_actors(pad_token_id=tokenizer.pad_id, checkpoint_dir=checkpoint)
            # 3. Restore the rest of the checkpoint.
            if checkpoint:
                run.restore(checkpoint)
                print(f"Resumed from {checkpoint} at step {run.state.step}")
            evaluate = build_evaluator(cfg, datasets.get("eval_dataset"), run)

            # 4. The loop.
            started = time.monotonic()
            try:
                with progress_bar(cfg.orchestration.num_steps, run.state) as on_step:
                    state = run.run(evaluate=evaluate, on_step=on_step)
            except (ActorFailedError, TrainingDivergedError, NoInformativeGroupsError) as error:
                print(f"Run stopped: {error}", file=sys.stderr)
                raise

            # 5. Checkpoint where a signal stopped the run.
            if run.stop_requested:
                saved = run.save_checkpoint()
                print(f"Stopped at step {state.step}; resume with resume_from_checkpoint={saved}")
                return {"steps": state.step, "stopped": True, "checkpoint": str(saved)}

            # 6. Verify the weights, save the final policy, end every actor.
            weights_in_sync = run.verify_weight_sync()
            final_dir = run.save_final_checkpoint()
            seconds = time.monotonic() - started
        except Exception:
            if not is_verbose(cfg.log_level):
                # The actors' own messages (a crash, an out-of-memory kill) are in their files.
                print(f"Each process's output: {logs_dir(run_dir)}/", file=sys.stderr)
            raise
        finally:
            run.shutdown()
    summary = {
        "steps": state.step,
        "policy_version": state.policy_version,
        "eval": [(step, m.get("eval/accuracy")) for step, m in state.eval_history],
        "weights_in_sync": weights_in_sync,
        "final_checkpoint": str(final_dir),
        "run_dir": str(run_dir),
        "seconds": seconds,
        "plots": write_plots(run_dir),
    }
    print_end(summary)
    return summary


def print_end(summary: dict) -> None:
    """The lines after the progress bar: accuracy, where the policy, metrics and plots are."""
    print(
        f"Run finished: {summary['steps']} steps in {tqdm.format_interval(summary['seconds'])}, "
        f"policy version {summary['policy_version']}"
    )
    accuracies = [f"{a:.3f} at step {step}" for step, a in summary["eval"] if a is not None]
    if accuracies:
        print(f"Held-out accuracy: {' -> '.join(accuracies)}")
    print(f"Final policy: {summary['final_checkpoint']}")
    run_dir = Path(summary["run_dir"])
    plots = summary["plots"]
    where_plots = f"; plots: {Path(plots[0]).parent}/ ({len(plots)} PNG)" if plots else ""
    print(f"Metrics: {run_dir / 'metrics.jsonl'}{where_plots}")


if __name__ == "__main__":
    run_recipe_cli(recipe_main)
