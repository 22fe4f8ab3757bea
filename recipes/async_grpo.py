"""Asynchronous GRPO on Ray.

    grpo run async_grpo --config tiny_arithmetic_cpu
    grpo run async_grpo --config qwen2_5_1_5b_gsm8k training.optimizer.lr=5e-7
    python recipes/async_grpo.py --config tiny_arithmetic_cpu orchestration.num_steps=10

The whole run, in order:

1. Validate the config (before anything expensive), make the run folder, start Ray.
2. Start the actors: metric logger, rollout queue, replay buffer, trainers (FSDP2 when there
   are several), reference actors, and vLLM collectors.
3. Drive them: collectors generate groups onto the queue; reference actors score them into
   the buffer; trainers sample batches, pack and step; every `steps_before_weight_sync` steps
   the new weights go to every collector. Held-out accuracy is measured before the first
   step, every `eval_every_n_steps`, and at the end.
4. Save the final policy as an HF-format folder (loads in vLLM and torchtune), write plots,
   and shut every actor down.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from grpo.config import instantiate, run_recipe_cli, validate_config
from grpo.evaluation import HeldOutEvaluator
from grpo.models import load_tokenizer
from grpo.orchestrator import (
    ActorFailedError,
    Orchestrator,
    TrainingDivergedError,
    find_checkpoint,
    init_ray,
)


def prepare_run_dir(cfg: DictConfig) -> Path:
    """Create the run folder and store the resolved config in it."""
    run_dir = Path(cfg.output_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    return run_dir


def check_data(cfg: DictConfig) -> None:
    """Load the datasets once up front: report skipped rows, fail on an empty set."""
    for key in ("dataset", "eval_dataset"):
        if cfg.get(key) is None:
            continue
        dataset = instantiate(cfg[key])
        if len(dataset) == 0:
            raise ValueError(f"{key}: no usable examples")
        skipped = getattr(dataset, "skipped", None)
        if skipped is not None and skipped.count:
            print(f"{key}: {skipped.summary()}", file=sys.stderr)


def recipe_main(cfg: DictConfig) -> dict:
    """Run asynchronous GRPO as the config says.

    Args:
        cfg (DictConfig): A run config (see ``configs/``).

    Returns:
        dict: Final step, policy version, held-out accuracy history and output paths.
    """
    validate_config(cfg)
    check_data(cfg)
    run_dir = prepare_run_dir(cfg)
    init_ray(cfg)
    tokenizer = load_tokenizer(cfg.base_model_path)

    checkpoint = find_checkpoint(run_dir, cfg.resume_from_checkpoint)

    run = Orchestrator(cfg, run_dir, tokenizer)
    # Ctrl-C / SIGTERM: finish the current step, save a checkpoint, end every actor.
    previous_handlers = {
        sig: signal.signal(sig, lambda *_: run.request_stop())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        run.start_actors(pad_token_id=tokenizer.pad_id, checkpoint_dir=checkpoint)
        if checkpoint:
            print(f"Resumed from {checkpoint} at step {run.state.step}")
        evaluator = HeldOutEvaluator.from_config(cfg, run.collectors[0], run.metric_logger)

        num_steps = cfg.orchestration.num_steps
        started = time.monotonic()
        with tqdm(
            total=num_steps, initial=run.state.step, desc="GRPO", unit="step", file=sys.stdout
        ) as bar:

            def show_progress(state) -> None:
                metrics = state.last_metrics
                postfix = {"v": state.policy_version}
                if "ref_actor_rewards/rewards_mean" in metrics:
                    postfix["reward"] = f"{metrics['ref_actor_rewards/rewards_mean']:.3f}"
                if "train_actor_training/loss" in metrics:
                    postfix["loss"] = f"{metrics['train_actor_training/loss']:.4f}"
                if state.eval_history:
                    postfix["eval_acc"] = f"{state.eval_history[-1][1]['eval/accuracy']:.3f}"
                bar.set_postfix(postfix)
                bar.update(1)

            try:
                state = run.run(
                    # The current collector: a dead one is replaced.
                    evaluate=(lambda step: evaluator(step, run.collectors[0]))
                    if evaluator
                    else None,
                    on_step=show_progress,
                )
            except (ActorFailedError, TrainingDivergedError) as error:
                print(f"Run stopped: {error}", file=sys.stderr)
                raise
        if run.stop_requested:
            saved = run.save_checkpoint()
            print(f"Stopped at step {state.step}; resume with resume_from_checkpoint={saved}")
            return {"steps": state.step, "stopped": True, "checkpoint": str(saved)}
        weights_in_sync = run.verify_weight_sync()
        final_dir = run.save_final_checkpoint()
        summary = {
            "steps": state.step,
            "policy_version": state.policy_version,
            "eval": [(step, m.get("eval/accuracy")) for step, m in state.eval_history],
            "weights_in_sync": weights_in_sync,
            "final_checkpoint": str(final_dir),
            "run_dir": str(run_dir),
            "seconds": time.monotonic() - started,
        }
    finally:
        run.shutdown()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)

    try:
        from grpo.plotting import plot_run

        summary["plots"] = [str(p) for p in plot_run(run_dir)]
    except Exception as error:  # plots are a convenience; never fail a finished run on them
        print(f"could not write plots: {error}", file=sys.stderr)
        summary["plots"] = []
    print(f"Run finished: {summary['steps']} steps, final policy in {final_dir}")
    for step, accuracy in summary["eval"]:
        print(f"  held-out accuracy at step {step}: {accuracy:.3f}")
    for path in summary["plots"]:
        print(f"  plot: {path}")
    return summary


if __name__ == "__main__":
    run_recipe_cli(recipe_main)
