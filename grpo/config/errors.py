"""The errors of config handling: every problem names its key and what was expected."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """One or more problems with a config; `problems` lists each as ``key: what is wrong``.

    Args:
        problems (str | Sequence[str]): One problem or a list of them.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            message = f"config has {len(self.problems)} problems:\n{lines}"
        super().__init__(message)


class InstantiationError(ConfigError):
    """A ``_component_`` node could not be built: bad import path or bad keyword arguments."""
