"""The options mechanism's former place: it lives in `grpo.config.options` (datasets use it
too). Kept while ``tests/unit/test_envs.py`` and ``docs/environments.md`` still name this path."""

from grpo.config.options import checked_options, option_problems

__all__ = ["checked_options", "option_problems"]
