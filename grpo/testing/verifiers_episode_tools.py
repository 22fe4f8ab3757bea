"""The add-tool taskset with its tool server started per episode (a task-scoped toolset).

Same tasks, tool and rewards as `grpo.testing.verifiers_add_tool`, but the ``add`` tool is
declared in ``Task.toolsets``, so verifiers starts a server process for every episode (each
gets its own task) instead of one for the whole taskset; ``scripts/bench_verifiers_tools.py``
compares the two. Needs the verifiers extra.
"""

from __future__ import annotations

import verifiers.v1 as vf

from grpo.testing.verifiers_arithmetic import SUMS, SumData, SumTask

__all__ = ["EpisodeAddToolTaskset"]


class EpisodeAddTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is "add", not "<server>_add"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class EpisodeAddTask(SumTask):
    @classmethod
    def toolsets(cls, config):
        # One tool server per episode.
        return [EpisodeAddTools(vf.ToolsetConfig())]


class EpisodeAddToolTaskset(vf.Taskset[EpisodeAddTask]):
    def load(self):
        for question, answer in SUMS:
            data = SumData(prompt=question, answer=answer, system_prompt="Use the add tool.")
            yield EpisodeAddTask(data, self.config.task)


if __name__ == "__main__":
    EpisodeAddTools.run()
