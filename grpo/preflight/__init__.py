"""Checks of a config for a run about to start: the config, and what it names.

`grpo.config` checks a config alone; what the config names (model folder, dataset files, tools,
run folder, resume checkpoint) is checked here, above the config, which then knows no
component. `load_run_config` reports every problem of both kinds at once.

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
