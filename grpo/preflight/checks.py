"""One check of a config for a run: `grpo.config.check_config`, then what it names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from grpo.config import ConfigError, RunConfig, check_config, compose_config, locate
from grpo.config.options import option_problems
from grpo.config.run import UNRESOLVED
from grpo.preflight.files import file_problems
from grpo.preflight.lora import lora_problems
from grpo.preflight.placement import local_cluster_problems
from grpo.preflight.resume import resume_problems
from grpo.preflight.teacher import teacher_problems


def import_component(path: str) -> Any:
    """Import the object at a dotted path, as `grpo.config.locate` does.

    For a torchtune path, `grpo.models.torchao_compat` is imported first: it lets
    ``torchtune.training`` import.

    Raises:
        InstantiationError: Naming the path, what could not be found, and a close name if any.
    """
    if path.split(".")[0] == "torchtune":
        import grpo.models.torchao_compat  # noqa: F401  (only for a torchtune path)
    return locate(path)


def preflight_problems(
    values: dict[str, Any], run: RunConfig | None, this_machine: bool = True
) -> list[str]:
    """Problems of what a config names: files, datasets, environment, resume target.

    Args:
        values (dict[str, Any]): The config as plain values, interpolations resolved (failed
            ones are `UNRESOLVED`): `grpo.config.validation.CheckedConfig.values`.
        run (RunConfig | None): The typed config, when it checked; a resume's checks need it.
        this_machine (bool): The run starts here: check this machine's Ray cluster, the
            model's weights, tokenizer and chat template, and the datasets' files. False
            (planning a run elsewhere, ``grpo validate --gpu-memory``): of what the run will
            read, only the model's ``config.json`` (`grpo.preflight.files.model_config_file`).

    Returns:
        list[str]: Each problem as ``key: what is wrong``.
    """
    problems = local_cluster_problems(values, this_machine)
    problems.extend(file_problems(values, this_machine))
    problems.extend(teacher_problems(values, this_machine))
    if this_machine:
        problems.extend(_dataset_problems(values))
    problems.extend(_environment_problems(values, this_machine))
    problems.extend(lora_problems(values))
    if run is not None:  # a resume may not change what its checkpoint's state was made for
        problems.extend(resume_problems(run.model_dump()))
    return problems


def validate_run_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    check_components: bool = True,
    import_components: bool = True,
    this_machine: bool = True,
) -> RunConfig:
    """Check a config and what it names; return it typed, or report every problem at once.

    Args:
        check_components (bool): Check that every ``_component_`` exists and takes the keyword
            arguments its node gives.
        import_components (bool): Check by importing the components (exact; loads torch and
            the like); False reads their source instead (fast; ``grpo validate``).
        this_machine (bool): The run starts on this machine; False checks, of what the run
            will read, only the model's ``config.json`` (see `preflight_problems`).

    Returns:
        RunConfig: The typed config, interpolations resolved.

    Raises:
        ConfigError: Listing every problem, each as ``key: what is wrong``.
    """
    checked = check_config(
        cfg,
        check_components=check_components,
        import_components=import_components,
        importer=import_component,
    )
    problems = checked.problems + preflight_problems(checked.values, checked.run, this_machine)
    if problems:
        raise ConfigError(problems)
    assert checked.run is not None
    return checked.run


def load_run_config(
    name_or_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    check_components: bool = False,
    import_components: bool = False,
    this_machine: bool = True,
) -> RunConfig:
    """Load a config as `grpo.config.load_config` does, and check what it names too.

    Args:
        name_or_path (str | Path): Config name (``configs/NAME.yaml``) or path to a YAML file.
        overrides (Sequence[str]): ``key.sub=value`` (value parsed as YAML) or ``~key``.
        check_components, import_components, this_machine: As `validate_run_config`.

    Returns:
        RunConfig: The typed config, interpolations resolved.

    Raises:
        ConfigError: Listing every problem at once, each as ``key: what is wrong``.
    """
    return validate_run_config(
        compose_config(name_or_path, overrides),
        check_components=check_components,
        import_components=import_components,
        this_machine=this_machine,
    )


def _dataset_problems(values: dict[str, Any]) -> list[str]:
    """What the dataset nodes say: values their factory refuses, missing files and columns,
    template mismatches."""
    # The checks of a source's files live beside the loaders that read them; they import
    # neither torch nor the hub.
    from grpo.data.preflight import dataset_problems

    problems = []
    model_path = values.get("base_model_path")
    for key in ("dataset", "eval_dataset"):
        node = values.get(key)
        if isinstance(node, dict) and isinstance(node.get("_component_"), str):
            unresolved = any(value is UNRESOLVED for value in node.values())
            if not unresolved:
                problems.extend(_option_problems(key, node))
                problems.extend(
                    dataset_problems(key, node, model_path if isinstance(model_path, str) else None)
                )
    return problems


def _option_problems(key: str, node: dict[str, Any]) -> list[str]:
    """The values a `grpo.data` dataset factory refuses by its options' declarations; only
    those are imported here (no torch); a factory of your own is checked when built."""
    if not str(node["_component_"]).startswith("grpo.data."):
        return []
    try:
        component = locate(node["_component_"])
    except Exception:  # a missing component is the component check's to report
        return []
    arguments = {name: value for name, value in node.items() if name != "_component_"}
    return [f"{key}.{problem}" for problem in option_problems(component, arguments)]


def _environment_problems(values: dict[str, Any], this_machine: bool = True) -> list[str]:
    """What the environment node's tools say: imports and type hints (no torch); with
    ``this_machine``, whether the model folder's chat template renders its turns."""
    node = values.get("environment")
    if not isinstance(node, dict) or any(value is UNRESOLVED for value in node.values()):
        return []
    # Beside the tools they check; only a config with an environment imports them.
    from grpo.envs.preflight import chat_template_problems, data_problems, environment_problems

    # `locate` names the close match of a mistyped tool path, as for every other dotted path.
    problems = data_problems(values, locate)
    problems += environment_problems("environment", node, locate)
    dataset = values.get("dataset")
    template = dataset.get("template") if isinstance(dataset, dict) else None
    if this_machine and not problems and isinstance(template, dict):
        base_model_path = values.get("base_model_path")
        problems += chat_template_problems(
            "dataset.template",
            template,
            node,
            base_model_path if isinstance(base_model_path, str) else None,
        )
    return problems
