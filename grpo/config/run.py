"""The run config: top-level options, the sections of each component, and checks across them.

`RunConfig` is the whole YAML file as one typed object. Each section's options are declared
beside the component they configure (`InferenceConfig` in `grpo.workers.collector`, `RefConfig`
in `grpo.workers.ref`, `TrainingConfig` in `grpo.workers.trainer`, `RayConfig` and
`OrchestrationConfig` in `grpo.orchestrator.config` for the driver). The checks that involve more than one section
(token budget vs prompt and response lengths, batch divisibility, buffer size, Ray resources,
the model folder) are here, in one place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.config.loading import resolve_path
from grpo.config.options import (
    NON_NEGATIVE,
    NONE,
    NUMBER,
    POSITIVE,
    UNRESOLVED,
    ConfigSection,
    component,
    component_list,
    keyword,
    one_of,
    option,
    section,
    type_ok,
)
from grpo.models import SUPPORTED_MODEL_TYPES
from grpo.orchestrator.config import OrchestrationConfig, RayConfig
from grpo.workers.collector import InferenceConfig
from grpo.workers.ref import RefConfig
from grpo.workers.trainer import TrainingConfig

# Files a model folder must hold; weights are checked separately (*.safetensors).
MODEL_FILES = ("config.json", "tokenizer.json")


@dataclass(kw_only=True)
class RunConfig(ConfigSection):
    """Top level.

    The whole run config as one typed object: top-level options, one section per component,
    and the component nodes (dataset, rewards, tokenizer, model, metric logger). Build it
    from a validated config with ``RunConfig.from_mapping(OmegaConf.to_container(cfg,
    resolve=True))``.
    """

    base_model_path: str = option(
        doc="Hugging Face model folder (config.json, *.safetensors, tokenizer.json). "
        "Relative: current directory first, then the repo root."
    )
    output_dir: str = option(doc="Checkpoints, metrics and logs are written here.")
    seed: int = option(0, "Seed for data order, sampling and initialisation.")
    target_tokens_per_batch: int = option(
        4096,
        "Token budget of one packed micro-batch (prompt + response tokens). The longest "
        "possible sequence must fit.",
        check=POSITIVE,
    )
    resume_from_checkpoint: bool | str = option(
        False,
        "false: start fresh; true: resume from the latest checkpoint in output_dir; a path: "
        "resume from that checkpoint.",
    )
    debug_logging_enabled: bool = option(False, "Log decoded sample prompts/responses every step.")
    debug_num_samples_per_step: int = option(
        1, "How many samples the debug log shows per step.", check=NON_NEGATIVE
    )
    eval_every_n_steps: int | None = option(
        None, "Evaluate on eval_dataset every N training steps; null: never.", check=POSITIVE
    )
    eval_num_examples: int | None = option(
        None, "Held-out examples per evaluation; null: all of eval_dataset.", check=POSITIVE
    )
    ray: RayConfig = section(RayConfig)
    orchestration: OrchestrationConfig = section(OrchestrationConfig)
    inference: InferenceConfig = section(InferenceConfig)
    ref: RefConfig = section(RefConfig)
    training: TrainingConfig = section(TrainingConfig)
    reward_functions: list[Any] = component_list(
        "Reward functions; each scores every response, the rewards are summed."
    )
    dataset: dict[str, Any] = component(doc="Training prompts and answers.")
    eval_dataset: dict[str, Any] | None = component(
        None, "Evaluation prompts; null: no evaluation."
    )
    tokenizer: dict[str, Any] = component(
        {"_component_": "grpo.models.load_tokenizer", "model_dir": "${base_model_path}"},
        "Tokenizer.",
        kwargs={
            "max_seq_len": keyword(
                (int, NONE), "Longest encoded sequence; null: no limit.", POSITIVE
            )
        },
    )
    model: dict[str, Any] = component(
        {"_component_": "grpo.models.build_model", "model_dir": "${base_model_path}"},
        "Policy and reference model (torchtune module, HF weights).",
    )
    metric_logger: dict[str, Any] = component(
        doc="Metric logger (W&B, JSONL, stdout).",
        kwargs={
            "mode": keyword(
                (str,),
                "W&B mode: online, offline or disabled.",
                one_of("online", "offline", "disabled"),
            ),
            "project": keyword((str,), "W&B project."),
            "log_dir": keyword((str,), "Folder for local logs."),
        },
    )

    @staticmethod
    def relation_problems(values: dict, check_files: bool = True) -> list[str]:
        """Problems that involve more than one key, and with the files a config names.

        Each check skips when a key it needs is itself invalid (that key is reported on its
        own).

        Args:
            values (dict): The config as plain values, interpolations resolved (failed ones
                are `UNRESOLVED`).
            check_files (bool): Also check the model folder and the resume checkpoint.

        Returns:
            list[str]: Each problem as ``key: what is wrong``.
        """
        problems: list[str] = []
        _check_relations(values, problems)
        if check_files:
            _check_files(values, problems)
        return problems


def _get(values: dict, path: str, types: tuple[type, ...] = NUMBER) -> Any:
    """Value at a dotted path if present, resolved and of `types` (bool never a number)."""
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is UNRESOLVED or node is None or not type_ok(node, types):
        return None
    return node


def _max_prompt(values: dict) -> tuple[int, str] | None:
    """Longest possible prompt and the key that bounds it, or None if neither key is set."""
    bounds = [
        (limit, key)
        for key in ("inference.max_prompt_tokens", "tokenizer.max_seq_len")
        if (limit := _get(values, key, (int,))) is not None
    ]
    # The tokenizer truncates to max_seq_len, so the smaller bound is the real one.
    return min(bounds) if bounds else None


def _check_relations(values: dict, problems: list[str]) -> None:
    """Checks that involve more than one key; each skips when a key it needs is invalid."""
    inference = values.get("inference") if isinstance(values.get("inference"), dict) else {}
    tokenizer = values.get("tokenizer") if isinstance(values.get("tokenizer"), dict) else {}
    max_prompt = _max_prompt(values)
    if (
        max_prompt is None
        and inference.get("max_prompt_tokens") is None
        and tokenizer.get("max_seq_len") is None
    ):
        problems.append(
            "inference.max_prompt_tokens: null while tokenizer.max_seq_len is not set; one of "
            "them must bound the prompt length so that packs can be sized"
        )
    max_generated = _get(values, "inference.max_generated_tokens", (int,))
    if max_prompt is not None and max_generated is not None:
        (prompt_tokens, prompt_key), longest = max_prompt, max_prompt[0] + max_generated
        bound = (
            f"{prompt_key} ({prompt_tokens}) + inference.max_generated_tokens "
            f"({max_generated}) = {longest}"
        )
        budget = _get(values, "target_tokens_per_batch", (int,))
        if budget is not None and budget < longest:
            problems.append(
                f"target_tokens_per_batch: {budget} cannot hold the longest sequence, {bound}"
            )
        max_model_len = _get(values, "inference.engine_args.max_model_len", (int,))
        if max_model_len is not None and max_model_len < longest:
            problems.append(
                f"inference.engine_args.max_model_len: {max_model_len} is shorter than {bound}"
            )

    train_batch = _get(values, "training.batch_size", (int,))
    num_trainers = _get(values, "orchestration.num_training_workers", (int,))
    if train_batch is not None and num_trainers and train_batch % num_trainers:
        problems.append(
            f"training.batch_size: {train_batch} is not divisible by "
            f"orchestration.num_training_workers ({num_trainers}); each worker trains on an "
            "equal share"
        )
    # training.batch_size need not be a multiple of inference.group_size: advantages are
    # computed per whole group before trajectories enter the buffer, so a step may mix groups.
    buffer_size = _get(values, "orchestration.replay_buffer_size", (int,))
    if buffer_size is not None and train_batch is not None and buffer_size < train_batch:
        problems.append(
            f"orchestration.replay_buffer_size: {buffer_size} is smaller than "
            f"training.batch_size ({train_batch}); a batch could never be sampled"
        )

    if (
        _get(values, "eval_every_n_steps", (int,)) is not None
        and values.get("eval_dataset") is None
    ):
        problems.append("eval_every_n_steps: set, but eval_dataset is null")

    weights = _get(values, "ref.reward_weights", (list,))
    functions = values.get("reward_functions")
    if weights is not None:
        if not all(type_ok(weight, NUMBER) for weight in weights):
            problems.append(f"ref.reward_weights: expected a list of numbers, got {weights!r}")
        elif isinstance(functions, list) and len(weights) != len(functions):
            problems.append(
                f"ref.reward_weights: {len(weights)} weights for {len(functions)} "
                "reward_functions; give one weight per function"
            )

    engine_args = _get(values, "inference.engine_args", (dict,))
    if engine_args and "model" in engine_args:
        problems.append("inference.engine_args.model: the model comes from base_model_path")

    _check_ray_resources(values, problems)


def _check_ray_resources(values: dict, problems: list[str]) -> None:
    """A local cluster must have room for every actor, or Ray waits forever to place one."""
    ray_section = values.get("ray")
    if not isinstance(ray_section, dict) or ray_section.get("address") is not None:
        return  # an existing cluster: its size is not known here
    roles = (
        ("inference", "num_inference_workers"),
        ("ref", "num_ref_workers"),
        ("training", "num_training_workers"),
    )
    for resource in ("num_cpus", "num_gpus"):
        needed, terms = 0.0, []
        for role, count_key in roles:
            per_actor = _get(values, f"{role}.{resource}")
            count = _get(values, f"orchestration.{count_key}", (int,))
            if per_actor is None or count is None:
                break
            needed += per_actor * count
            terms.append(f"{count} x {role}.{resource} ({per_actor})")
        else:
            if needed == 0:
                continue
            have = _get(values, f"ray.{resource}")
            if have is None:
                have = (os.cpu_count() or 1) if resource == "num_cpus" else _visible_gpus()
            if needed > have + 1e-9:
                problems.append(
                    f"ray.{resource}: the actors need {needed:g} ({' + '.join(terms)}) but the "
                    f"local Ray cluster has {have:g}; raise ray.{resource} or lower the "
                    "per-actor amounts"
                )


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _check_files(values: dict, problems: list[str]) -> None:
    model_path = values.get("base_model_path")
    if isinstance(model_path, str) and model_path:
        folder = resolve_path(model_path, fall_back_to_repo=True)
        if not folder.is_dir():
            problems.append(f"base_model_path: model folder {folder} does not exist")
        else:
            missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
            if not any(folder.glob("*.safetensors")):
                missing.append("*.safetensors")
            if missing:
                problems.append(
                    f"base_model_path: {folder} lacks {', '.join(missing)} (expected a "
                    "Hugging Face model folder)"
                )
            _check_model_config(folder, values, problems)
    resume = values.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume and not resolve_path(resume).exists():
        problems.append(f"resume_from_checkpoint: {resolve_path(resume)} does not exist")


def _check_model_config(folder: Path, values: dict, problems: list[str]) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        return
    try:
        model_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"base_model_path: {config_path} is not valid JSON: {exc}")
        return
    model_type = model_config.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(
            f"base_model_path: {config_path} has model_type {model_type!r}; supported model "
            f"types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    max_positions = model_config.get("max_position_embeddings")
    max_prompt = _max_prompt(values)
    max_generated = _get(values, "inference.max_generated_tokens", (int,))
    if isinstance(max_positions, int) and max_prompt is not None and max_generated is not None:
        longest = max_prompt[0] + max_generated
        if longest > max_positions:
            problems.append(
                f"inference.max_generated_tokens: {max_prompt[1]} ({max_prompt[0]}) + "
                f"inference.max_generated_tokens ({max_generated}) = {longest} exceeds the "
                f"model's max_position_embeddings ({max_positions}) in {config_path}"
            )
