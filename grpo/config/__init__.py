"""Run configs: typed sections, YAML loading with overrides, checks, and ``_component_`` nodes.

Options are declared once, as pydantic models (`grpo.config.sections`,
`grpo.config.run.RunConfig`), and everything else here is derived from those declarations.
Nothing in this package imports torch, Ray or vLLM, nor any part of grpo but `grpo.choices`:
components import their section from here, never the other way round. What a config names on
disk is checked above it, by `grpo.preflight`; options a component declares on its own
signature live in `grpo.config.options`.

Example:
    >>> cfg = load_config("tiny_arithmetic_cpu", ["inference.group_size=4"])
    >>> cfg.inference.group_size
    4
"""

from grpo.config.errors import ConfigError, InstantiationError
from grpo.config.instantiate import instantiate, locate
from grpo.config.loading import compose_config, load_config
from grpo.config.paths import configs_dir, find_config, list_configs, repo_root, resolve_path
from grpo.config.reference import config_reference_markdown
from grpo.config.run import RunConfig
from grpo.config.schema import (
    COMPONENT_DEFAULT,
    REQUIRED,
    Component,
    ComponentArgs,
    ComponentList,
    Section,
)
from grpo.config.sections import (
    CheckpointConfig,
    InferenceConfig,
    LoRAConfig,
    OrchestrationConfig,
    RayConfig,
    RefConfig,
    TrainingConfig,
    WeightSyncConfig,
)
from grpo.config.validation import CheckedConfig, check_config, validate_config

__all__ = [
    "COMPONENT_DEFAULT",
    "REQUIRED",
    "CheckedConfig",
    "CheckpointConfig",
    "Component",
    "ComponentArgs",
    "ComponentList",
    "ConfigError",
    "InferenceConfig",
    "InstantiationError",
    "OrchestrationConfig",
    "RayConfig",
    "RefConfig",
    "RunConfig",
    "Section",
    "LoRAConfig",
    "TrainingConfig",
    "WeightSyncConfig",
    "check_config",
    "compose_config",
    "config_reference_markdown",
    "configs_dir",
    "find_config",
    "instantiate",
    "list_configs",
    "load_config",
    "locate",
    "repo_root",
    "resolve_path",
    "validate_config",
]
