"""Checks of a config for a run about to start: the config, and what it names.

`grpo.config` checks a config alone: its keys, types, relations and component signatures. A
run also needs what the config names to be there and to fit: the model folder, the dataset
files, the environment's tools and chat template, a writable run folder, the checkpoint a
resume starts from and what that checkpoint was made for. Those checks read files and import
the components' own check modules (`grpo.data.preflight`, `grpo.envs.preflight`), so they live
here, above the config, which then knows no component. ``grpo validate`` and a recipe's
start-up (`grpo.recipe.run_recipe`) call `load_run_config`, which reports every problem of
both kinds at once, each as ``key: what is wrong``.

Example:
    >>> cfg = load_run_config("tiny_arithmetic_cpu", ["inference.group_size=4"])
    >>> cfg.inference.group_size
    4
"""

from grpo.preflight.checks import (
    import_component,
    load_run_config,
    preflight_problems,
    validate_run_config,
)
from grpo.preflight.files import file_problems, used_output_dir_problem
from grpo.preflight.resume import FIXED_ON_RESUME, resume_problems

__all__ = [
    "FIXED_ON_RESUME",
    "file_problems",
    "import_component",
    "load_run_config",
    "preflight_problems",
    "resume_problems",
    "used_output_dir_problem",
    "validate_run_config",
]
