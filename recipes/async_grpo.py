"""Asynchronous GRPO on Ray.

    grpo run async_grpo --config tiny_arithmetic_cpu
    grpo run async_grpo --config qwen2_5_1_5b_gsm8k training.optimizer.lr=5e-7
    python recipes/async_grpo.py --config tiny_arithmetic_cpu orchestration.num_steps=10

The whole run, in order (each stage is a line of `recipe_main`):

1. Build: the config arrives checked (``grpo run`` and ``python recipes/...`` check it before
   calling `recipe_main`); the datasets are built once, here, and the training set is shared
   by every collector; the run folder gets the resolved config.
2. Set up: start Ray or join the cluster (``ray.address``), check that each role's actors fit
   on its nodes, start the actors (metric logger, rollout queue, replay buffer, trainers
   (FSDP2 when there are several), reference actors, vLLM collectors), from a checkpoint's
   weights if one is resumed, then restore the rest of it (step, policy version, held and
   buffered groups).
3. Train: collectors generate groups onto the queue; reference actors score them into the
   buffer; trainers sample batches, pack and step; every ``weight_sync.every_n_steps`` steps
   the new weights go to every collector. Held-out accuracy is measured before the first
   step, every ``eval_every_n_steps``, and at the end. A checkpoint every
   ``checkpoint.save_every_n_steps``, and one when a signal stops the run.
4. Finish: save a checkpoint of the last step (unless the loop just did), verify that the
   collectors hold the trainer's weights, save the final policy as an HF-format folder (loads
   in vLLM and torchtune), shut every actor down, write plots.

What the terminal shows is `grpo.observability.console`'s: a few lines at the start, one
progress bar, the results; every process's own output goes to ``output_dir/logs/`` unless
``log_level`` is debug (`grpo.observability.logs`). A run that stops on an error says what
stopped it in one line, where its traceback is (``output_dir/logs/driver.log``) and the
checkpoint to resume from, and exits with 1.
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from grpo.config import ConfigError, RunConfig, instantiate
from grpo.config.run import reward_weights_problem
from grpo.envs import Environment, build_environment
from grpo.errors import (
    ActorFailedError,
    EnvironmentFailingError,
    NoInformativeGroupsError,
    RewardFailingError,
    TrainingDivergedError,
)
from grpo.models import load_tokenizer
from grpo.observability.console import (
    print_end,
    print_start,
    print_stopped,
    progress_bar,
    write_plots,
)
from grpo.observability.metric_names import EVAL_ACCURACY
from grpo.orchestrator import Orchestrator, check_placement, find_checkpoint, init_ray
from grpo.orchestrator.evaluation import HeldOutEvaluator
from grpo.recipe import run_recipe_cli


def recipe_main(cfg: RunConfig) -> dict:
    """Run asynchronous GRPO as the config says.

    Args:
        cfg (RunConfig): A checked run config (see ``configs/``).

    Returns:
        dict: Final step, policy version, held-out accuracy history and output paths.
    """
    environment = check_environment(cfg)  # 1. build
    check_reward_weights(cfg, environment)
    datasets = build_datasets(cfg, environment)
    tokenizer = load_tokenizer(cfg.base_model_path)
    check_prompt_lengths(cfg, datasets.get("dataset"), tokenizer)
    run_dir = prepare_run_dir(cfg)
    print_start(cfg, run_dir, datasets)
    init_ray(cfg)
    check_placement(cfg)  # a role no node can host is refused here, not left waiting
    run = Orchestrator(cfg, run_dir, tokenizer, dataset=datasets["dataset"])
    with stop_on_signals(run), shutdown_on_exit(run):
        checkpoint = set_up(run, cfg, run_dir)  # 2. set up
        # What this invocation starts from: the results say what it ran, and which are older.
        first_step, earlier_evals = run.state.step, len(run.state.eval_history)
        evaluate = build_evaluator(cfg, datasets.get("eval_dataset"), run)
        started = time.monotonic()
        state, stopped_by = train(run, cfg, evaluate)  # 3. train
        if stopped_by is not None:
            # The run stopped on its own: one line why, the traceback in driver.log.
            reason = print_stopped(stopped_by, run_dir, cfg.log_level)
            return {"steps": state.step, "stopped": True, "error": reason, "exit_code": 1}
        if run.stop_requested:
            saved = run.save_checkpoint()
            print(f"Stopped at step {state.step}; resume with resume_from_checkpoint={saved}")
            # 128 + the signal, as a shell reports a process the signal ended: a script can
            # tell an interrupted run (130 for Ctrl-C, 143 for SIGTERM) from a finished one.
            exit_code = 128 + run.stop_signal if run.stop_signal else 1
            return {
                "steps": state.step,
                "stopped": True,
                "checkpoint": str(saved),
                "exit_code": exit_code,
            }
        if run.checkpointed_step != state.step:
            # The end of a run is a checkpoint too: `latest` then names the newest step, and
            # a longer run (a larger num_steps, resume_from_checkpoint=true) goes on from it.
            run.save_checkpoint()
        weights_in_sync = run.verify_weight_sync()  # 4. finish
        final_dir = run.save_final_checkpoint()
        seconds = time.monotonic() - started
    summary = {
        "steps": state.step,
        "policy_version": state.policy_version,
        "eval": [(step, m.get(EVAL_ACCURACY)) for step, m in state.eval_history],
        "weights_in_sync": weights_in_sync,
        "final_checkpoint": str(final_dir),
        "run_dir": str(run_dir),
        "seconds": seconds,
        "plots": write_plots(run_dir),
        "resumed_from": str(checkpoint) if checkpoint else None,
        "resumed_at_step": first_step if checkpoint else None,
        "evals_before_resume": earlier_evals,
    }
    print_end(summary)
    return summary


# ---------------------------------------------------------------------------------- stages


def set_up(run: Orchestrator, cfg: RunConfig, run_dir: Path) -> Path | None:
    """Start the actors, from the checkpoint being resumed if any, and restore the rest of it.

    Returns:
        Path | None: The checkpoint resumed from.
    """
    checkpoint = find_checkpoint(run_dir, cfg.resume_from_checkpoint)
    run.start_actors(pad_token_id=run.tokenizer.pad_id, checkpoint_dir=checkpoint)
    if checkpoint:
        run.resume(checkpoint)
        print(f"Resumed from {checkpoint} at step {run.state.step}")
    return checkpoint


def train(run: Orchestrator, cfg: RunConfig, evaluate: Any) -> tuple[Any, Exception | None]:
    """The loop, under the progress bar; a run that stops on its own returns why.

    Returns:
        tuple[RunState, Exception | None]: The final step, policy version and metrics, and the
        error the run stopped on by its own decision (an actor that failed, a diverged loss,
        an environment failing its episodes, a reward function failing its calls, no
        informative group), or None. Any other error
        propagates (`grpo.recipe.run_recipe` reports it the same way).
    """
    try:
        with progress_bar(cfg.orchestration.num_steps, run.state) as on_step:
            return run.run(evaluate=evaluate, on_step=on_step), None
    except (
        ActorFailedError,
        TrainingDivergedError,
        NoInformativeGroupsError,
        EnvironmentFailingError,
        RewardFailingError,
    ) as error:
        return run.state, error


@contextmanager
def shutdown_on_exit(run: Orchestrator):
    """End every actor however the run ends."""
    try:
        yield
    finally:
        run.shutdown()


# ---------------------------------------------------------------------------------- builders


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create the run folder and store the resolved config in it."""
    run_dir = Path(cfg.output_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return run_dir


def build_datasets(cfg: RunConfig, environment: Environment) -> dict[str, Any]:
    """Build ``dataset`` and ``eval_dataset`` once: report skipped rows, fail on an empty set.

    Without a ``dataset``, the environment's own tasks are the dataset (a verifiers taskset, a
    reasoning-gym environment); without an ``eval_dataset``, its held-out rows are, if it has
    them (`Environment.eval_examples`).

    Returns:
        dict[str, Any]: The built datasets by config key (absent keys left out).

    Raises:
        ValueError: If a dataset has no usable example.
    """
    datasets = {}
    for key in ("dataset", "eval_dataset"):
        node = getattr(cfg, key)
        if node is None:
            # An environment with its own tasks: its rows, and its held-out rows.
            own = environment.examples() if key == "dataset" else environment.eval_examples()
            if own is not None:
                datasets[key] = own
            continue
        try:
            dataset = datasets[key] = instantiate(node, _key_=key)
        except (ValueError, TypeError) as err:  # a bad value the constructor caught: one line
            raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from err
        if len(dataset) == 0:
            raise ValueError(f"{key}: no usable examples")
        skipped = getattr(dataset, "skipped", None)
        if skipped is not None and skipped.count:
            print(f"{key}: {skipped.summary()}", file=sys.stderr)
    return datasets


def check_environment(cfg: RunConfig) -> Environment:
    """Build the environment once here, so that a bad value is one line before Ray starts.

    The collectors build their own from the same node.

    Returns:
        Environment: The ``environment:`` node's, or the single-turn environment of the
        reward functions; a verifiers environment's tasks are the dataset of a run that
        names none.

    Raises:
        ConfigError: If it cannot be built (e.g. ``max_turns: 0``).
    """
    return build_environment(cfg.environment, cfg.reward_functions, cfg.reward_timeout_s)


def check_prompt_lengths(cfg: RunConfig, dataset: Any, tokenizer: Any, sample: int = 64) -> None:
    """Refuse a ``max_prompt_tokens`` no prompt fits, before Ray starts.

    The collectors skip prompts longer than ``inference.max_prompt_tokens`` (and count them);
    a limit that the first ``sample`` prompts all exceed (a chat template's system header is
    longer than the limit, say) would only stop a collector once its actors run.

    Raises:
        ConfigError: Naming the limit, the shortest prompt seen and the template.
    """
    limit = cfg.inference.max_prompt_tokens
    if limit is None or dataset is None or len(dataset) == 0:
        return
    template = getattr(dataset, "template", None)
    add_bos = bool(getattr(template, "add_bos", True))
    lengths = []
    for index in range(min(sample, len(dataset))):
        text = dataset[index].get("prompt")
        if text is None:  # a dataset whose prompts the environment renders
            return
        lengths.append(len(tokenizer.encode(text, add_bos=add_bos, add_eos=False)))
    if min(lengths) > limit:
        raise ConfigError(
            f"inference.max_prompt_tokens: {limit} is shorter than every prompt of the first "
            f"{len(lengths)} of dataset (the shortest is {min(lengths)} tokens with its template "
            f"{template!r}); raise it to at least {max(lengths)} (and max_model_len with it)"
        )


def check_reward_weights(cfg: RunConfig, environment: Environment) -> None:
    """Refuse a ``ref.reward_weights`` name that no reward has, before Ray starts.

    The names are those the environment scores under (`grpo.envs.Environment.reward_names`:
    its reward functions'); an environment that knows its names only once it scores (a
    verifiers taskset) has them checked by the reference actor then.

    Raises:
        ConfigError: Naming the unknown names and the rewards there are.
    """
    weights = cfg.ref.reward_weights
    if not weights:
        return
    names = environment.reward_names()
    if names is not None and (problem := reward_weights_problem(weights, names)):
        raise ConfigError(problem)


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
        samples_per_example=cfg.eval_samples_per_example,
        temperature=cfg.eval_temperature,
    )
    return lambda step: evaluator(step, run.collectors[0])


@contextmanager
def stop_on_signals(run: Orchestrator):
    """Ctrl-C / SIGTERM: finish the current step, save a checkpoint, end every actor; the
    process then exits with 130 / 143."""
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: run.request_stop(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    run_recipe_cli(recipe_main)
