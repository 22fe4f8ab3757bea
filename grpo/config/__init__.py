"""YAML configs: load, override from the command line, validate, and instantiate components.

A config is a YAML file laid out like torchtune's async GRPO config. Its options are declared
once, as typed dataclasses next to the components they configure, and everything else here is
derived from those declarations. The parts:

* `options`: how a component declares its options (`option`, `component`, `ConfigSection`).
* `run`: `RunConfig`, the whole file as one typed object, and the checks across sections.
* `loading`: find a config by name or path, apply ``key=value`` / ``~key`` overrides, fill
  defaults (`load_config`).
* `validation`: report every problem of a config at once, with did-you-mean hints
  (`validate_config`).
* `instantiate`: build a ``_component_`` node (`instantiate`).
* `recipes`: the command line of a recipe (`run_recipe`, `parse`).
* `reference`: the README's config reference (`config_reference_markdown`).

Example:
    >>> cfg = load_config("tiny_arithmetic_cpu", ["inference.group_size=4"])
    >>> validate_config(cfg)
    >>> run = RunConfig.from_mapping(OmegaConf.to_container(cfg, resolve=True))
    >>> run.inference.group_size
    4
"""

# Nothing here imports a component module: they import `instantiate` and `options` from here.
from grpo.config.errors import ConfigError, InstantiationError
from grpo.config.instantiate import instantiate, locate
from grpo.config.loading import (
    configs_dir,
    find_config,
    list_configs,
    load_config,
    repo_root,
    resolve_path,
)
from grpo.config.options import (
    COMPONENT_DEFAULT,
    REQUIRED,
    Component,
    ComponentList,
    ConfigSection,
    Field,
    Section,
    run_schema,
    section_of,
)
from grpo.config.recipes import (
    Recipe,
    add_verbose_flag,
    parse,
    run_recipe,
    run_recipe_cli,
    split_overrides,
)
from grpo.config.reference import config_reference_markdown
from grpo.config.validation import validate_config

__all__ = [
    "COMPONENT_DEFAULT",
    "REQUIRED",
    "Component",
    "ComponentList",
    "ConfigError",
    "ConfigSection",
    "Field",
    "InstantiationError",
    "Recipe",
    "Section",
    "add_verbose_flag",
    "config_reference_markdown",
    "configs_dir",
    "find_config",
    "instantiate",
    "list_configs",
    "load_config",
    "locate",
    "parse",
    "repo_root",
    "resolve_path",
    "run_recipe",
    "run_recipe_cli",
    "run_schema",
    "section_of",
    "split_overrides",
    "validate_config",
]


def __getattr__(name: str):
    # `RunConfig` lives in grpo.config.run, which imports the component modules; loading it
    # lazily keeps `from grpo.config import instantiate` in those modules cycle-free.
    if name == "RunConfig":
        from grpo.config.run import RunConfig

        return RunConfig
    raise AttributeError(f"module 'grpo.config' has no attribute {name!r}")
