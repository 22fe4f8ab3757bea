"""A single-turn verifiers taskset for tests: sums of two small numbers.

Two weighted rewards and a metric, so that each reaches training and the logs under its own
name. ``__all__`` names its ``Taskset`` for verifiers' loader. Needs the verifiers extra.
"""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["SumTaskset"]

# (question, answer) rows; small sums the tiny test models can sometimes get right.
SUMS = tuple((f"What is {a} + {b}?", str(a + b)) for a, b in ((2, 3), (4, 1), (3, 3), (6, 2)))


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last reply holds the answer."""
        return 1.0 if self.data.answer in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        """1 when the last reply is at most 8 characters."""
        return 1.0 if len(trace.last_reply) <= 8 else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        """Characters of the last reply (logged, never trained on)."""
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for question, answer in SUMS:
            yield SumTask(SumData(prompt=question, answer=answer), self.config.task)
