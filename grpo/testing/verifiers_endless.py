"""A verifiers taskset for tests that never ends: sums drawn one after another, forever.

A procedural taskset (textarena's, reasoning-gym's) has no last row; `grpo.envs.verifiers_env`
reads it up to ``max_tasks`` rows. Needs the verifiers extra.
"""

from __future__ import annotations

import itertools

import verifiers.v1 as vf

from grpo.testing.verifiers_arithmetic import SumData, SumTask

__all__ = ["EndlessSumTaskset"]


class EndlessSumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for n in itertools.count():
            a, b = n % 7, n % 5
            yield SumTask(
                SumData(prompt=f"What is {a} + {b}?", answer=str(a + b)), self.config.task
            )
