"""Comparing trainer states: a resumed or restarted trainer must hold the same state, bit for bit,
as one that never stopped. The states come from `grpo.testing.gathered_training_state`, which
runs inside the trainer actors."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_training_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Assert two `gathered_training_state` results are equal bit for bit: weights, AdamW
    moments and step counts, and the optimizer's hyperparameters."""
    assert actual["steps_run"] == expected["steps_run"]
    torch.testing.assert_close(actual["model"], expected["model"], rtol=0, atol=0)
    torch.testing.assert_close(
        actual["optimizer"]["state"], expected["optimizer"]["state"], rtol=0, atol=0
    )
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
