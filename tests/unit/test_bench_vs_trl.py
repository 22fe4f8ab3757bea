"""``scripts/bench_vs_trl.py``'s steady-state statistic (the script itself needs TRL; this does not)."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script


def test_steady_state_leaves_out_the_warm_up_steps():
    steady_state = load_script("bench_vs_trl").steady_state
    # Step 1 ends after a long start-up; step 2 is slow too; steps 3-5 take 1, 2 and 1 s.
    ends = [100.0, 110.0, 111.0, 113.0, 114.0]
    tokens = [999.0, 999.0, 100.0, 200.0, 300.0]
    state = steady_state(ends, tokens, warmup_steps=2)
    assert state.measured_steps == 3
    assert state.window_s == pytest.approx(4.0)
    assert state.seconds_per_step == pytest.approx(4.0 / 3)
    assert state.median_step_s == pytest.approx(1.0)
    # Only the tokens of the measured steps, over the same window.
    assert state.completion_tokens == pytest.approx(600.0)
    assert state.tokens_per_s == pytest.approx(150.0)


@pytest.mark.parametrize(
    ("ends", "tokens", "warmup", "message"),
    [
        ([1.0, 2.0], [1.0], 1, "token counts"),
        ([1.0, 2.0], [1.0, 1.0], 2, "need more than"),
        ([1.0, 2.0], [1.0, 1.0], 0, "warmup_steps must be >= 1"),
        ([1.0, 3.0, 2.0], [1.0, 1.0, 1.0], 1, "must not decrease"),
    ],
)
def test_steady_state_rejects_bad_input(ends, tokens, warmup, message):
    with pytest.raises(ValueError, match=message):
        load_script("bench_vs_trl").steady_state(ends, tokens, warmup_steps=warmup)


def test_bf16_precision_sets_bfloat16_weights_in_the_trainer_and_the_engine():
    script = load_script("bench_vs_trl")
    assert script.PRECISION_OVERRIDES["fp32"] == ()
    overrides = [*script.DEMO_OVERRIDES, *script.PRECISION_OVERRIDES["bf16"]]
    cfg = script.load_workload_config(overrides)
    assert cfg.training.dtype == "bf16" and cfg.ref.dtype == "bf16"
    assert cfg.inference.engine_args["dtype"] == "bfloat16"
    default = script.load_workload_config(list(script.DEMO_OVERRIDES))
    assert default.training.dtype == "fp32" and default.inference.engine_args["dtype"] == "float32"
