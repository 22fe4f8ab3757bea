"""A tool-using verifiers taskset for tests: the ``add`` tool served over MCP, one reward.

verifiers serves a ``Toolset`` as an MCP server in a process of its own (``python -m`` this
module), so the toolset lives in an importable module; ``__all__`` names the ``Taskset``.
Needs the verifiers extra.
"""

from __future__ import annotations

import verifiers.v1 as vf

from grpo.testing.verifiers_arithmetic import SUMS, SumData, SumTask

__all__ = ["AddToolTaskset"]


class AddTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is "add", not "<server>_add"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddToolTaskset(vf.Taskset[SumTask]):
    def load(self):
        for question, answer in SUMS:
            data = SumData(prompt=question, answer=answer, system_prompt="Use the add tool.")
            yield SumTask(data, self.config.task)

    @classmethod
    def toolsets(cls, config):
        # One tool server for the whole taskset, shared by its episodes.
        return [AddTools(vf.SharedToolsetConfig())]


if __name__ == "__main__":
    AddTools.run()
