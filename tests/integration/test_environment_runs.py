"""Whole runs with a multi-turn environment: exact resume, a replaced collector (in the run the
resumed run must reproduce), and an environment that fails every episode.

The environment is `grpo.testing.tools.EchoUserEnv` (a user who answers every turn), with
stop strings the random tiny model writes often, so every step trains on real multi-turn
episodes whose environment tokens are masked from the loss.
"""

import re
import time
from pathlib import Path

import pytest

from grpo.cli import main as grpo_main
from grpo.observability.metric_names import (
    INFERENCE_EPISODE_ENV_TOKEN_FRACTION,
    INFERENCE_EPISODE_TURNS_MEAN,
    INFERENCE_EPISODES_DROPPED_TOTAL,
    INFERENCE_EPISODES_FAILED_SCORED,
    TRAIN_LOSS,
)
from grpo.testing import RANDOM_MODEL_OVERRIDES, kill_at_steps, read_jsonl, start_tiny_run

pytestmark = pytest.mark.slow

ENVIRONMENT = (
    "environment={_component_: grpo.testing.tools.EchoUserEnv, max_turns: 3, stop: [' ', 'e', 'a']}"
)
MULTI_TURN = [
    ENVIRONMENT,
    "inference.engine_args.max_model_len=256",
    "inference.max_generated_tokens=12",
    "inference.batch_size=4",
    "training.batch_size=32",
    "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
    "ref.reward_weights=null",
]


def trained_ids(run_dir: Path) -> list[str]:
    return [sid for r in read_jsonl(run_dir / "trained.jsonl") for sid in r["sequence_ids"]]


def metric(run_dir: Path, name: str) -> list[float]:
    return [r[name] for r in read_jsonl(run_dir / "metrics.jsonl") if name in r]


# The settings of the multi-turn runs that must reproduce one another exactly.
SYNCHRONOUS = (
    "orchestration.synchronous=true",
    "training.lr_scheduler=null",
    "checkpoint.save_every_n_steps=2",
    "eval_every_n_steps=null",
)


def test_multi_turn_resume_continues_exactly(tiny_model_dir, tmp_path, monkeypatch, ray_shared):
    """A run resumed from step 2's checkpoint of a 4-step multi-turn run trains steps 3 and 4
    exactly as that run did: the same episodes, in the same order, and the same losses.

    The 4-step run's collector is killed after step 3: its replacement plays the batch's
    episodes again, every step completes, and nothing is lost or trained twice. The resumed
    run, whose collector lives, trains the same steps 3 and 4, so the replacement changed
    nothing either (a run of its own for the replaced collector would pay another start-up)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    run = start_tiny_run(
        tiny_model_dir, straight, 4, "orchestration.stall_timeout_s=60", *SYNCHRONOUS, *MULTI_TURN
    )
    kill_at_steps(run, [(3, "inference[0]")])
    try:
        state = run.run()
    finally:
        run.shutdown()  # Ray stays up for the resumed run (`ray_shared`): one start less
    assert state.step == 4
    assert [r.actor for r in run.recoveries] == ["inference[0]"]
    scored = [sid for r in read_jsonl(straight / "scored.jsonl") for sid in r["sequence_ids"]]
    numbers = sorted({int(sid.split("-")[1]) for sid in scored})
    assert numbers == list(range(numbers[-1] + 1))
    assert len(set(trained_ids(straight))) == len(trained_ids(straight)) == 4 * 32
    assert set(trained_ids(straight)) <= set(scored)

    from_checkpoint = straight / "checkpoints" / "step_000002"
    assert (
        grpo_main(
            [
                *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
                f"base_model_path={tiny_model_dir}",
                *RANDOM_MODEL_OVERRIDES,
                f"output_dir={resumed}",
                "orchestration.num_steps=4",
                *SYNCHRONOUS,
                *MULTI_TURN,
                f"resume_from_checkpoint={from_checkpoint}",
            ]
        )
        == 0
    )

    straight_records = read_jsonl(straight / "trained.jsonl")
    assert [r["step"] for r in straight_records] == [1, 2, 3, 4]
    resumed_records = read_jsonl(resumed / "trained.jsonl")
    assert [r["step"] for r in resumed_records] == [3, 4]
    assert [r["sequence_ids"] for r in resumed_records] == [
        r["sequence_ids"] for r in straight_records[2:]
    ]
    losses = {r["step"]: r[TRAIN_LOSS] for r in read_jsonl(straight / "metrics.jsonl") if TRAIN_LOSS in r}  # fmt: skip
    resumed_losses = {r["step"]: r[TRAIN_LOSS] for r in read_jsonl(resumed / "metrics.jsonl") if TRAIN_LOSS in r}  # fmt: skip
    assert sorted(losses) == [1, 2, 3, 4] and sorted(resumed_losses) == [3, 4]
    for step in (3, 4):
        assert resumed_losses[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-9)

    # The episodes were multi-turn, and the environment's tokens were not trained.
    assert max(metric(straight, INFERENCE_EPISODE_TURNS_MEAN)) > 1.5
    assert max(metric(straight, INFERENCE_EPISODE_ENV_TOKEN_FRACTION)) > 0.05
    assert min(metric(straight, "training/trained_token_fraction")) < 0.95


# Reads state["anwser"] when it answers: every episode whose first turn ends on a stop string
# (nearly all: the random model writes these often) raises KeyError.
TYPO_ENVIRONMENT = (
    "environment={_component_: grpo.testing.tools.MisspeltStateEnv, max_turns: 3, "
    "stop: [' ', 'e', 'a', 'o', 't', '1', '2', '<'], failed_episodes: %s}"
)


@pytest.mark.parametrize(
    ("filtering", "failed_episodes"),
    [(False, "drop"), (True, "score")],
    ids=["no_filter_dropped", "dynamic_sampling_scored"],
)
def test_an_environment_that_fails_every_episode_stops_the_run_naming_its_error(
    filtering, failed_episodes, tiny_model_dir, tmp_path, monkeypatch, capsys, ray_shared
):
    """A typo in env_response: the run stops soon after its first batch, naming the KeyError
    and the line that raised it, with or without dynamic sampling (whose own guard would
    blame equal rewards), whether the failed episodes are dropped or scored with the failure
    reward in their groups; the collector's log names the reason once, with a count."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    status = grpo_main(
        [
            *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            "orchestration.num_steps=20",
            "eval_every_n_steps=null",
            f"ref.filter_zero_variance_groups={str(filtering).lower()}",
            "orchestration.stall_timeout_s=60",
            TYPO_ENVIRONMENT % failed_episodes,
            "inference.engine_args.max_model_len=256",
            "inference.max_generated_tokens=24",
            "inference.batch_size=2",
            "inference.group_size=4",
            "training.batch_size=16",
        ]
    )
    stopped_at = time.time()
    err = capsys.readouterr().err
    assert status == 1, err
    first_batch = min(r["time"] for r in read_jsonl(run_dir / "metrics.jsonl") if INFERENCE_EPISODES_FAILED_SCORED in r)  # fmt: skip
    # Stopped within seconds of the first batch (shutting the actors down included).
    assert stopped_at - first_batch < 60

    # One line says what stopped it: the exception, its message and where the environment
    # raised it; the traceback is in driver.log, not on the terminal.
    stopped = next(line for line in err.splitlines() if line.startswith("Run stopped: "))
    assert "the environment failed nearly every episode" in stopped
    assert "KeyError: 'anwser' (at " in stopped and 'state["anwser"]' in stopped
    assert "grpo/testing/tools.py:" in stopped and "in env_response" in stopped
    assert "equal rewards" not in err and "temperature" not in err
    assert "Traceback (most recent call last)" not in err
    assert f"Traceback: {run_dir / 'logs' / 'driver.log'}" in err
    assert "EnvironmentFailingError" in (run_dir / "logs" / "driver.log").read_text()

    # The collector's log names the reason once, with a count, however many episodes it
    # dropped (or scored with the failure reward) for it.
    if failed_episodes == "drop":
        failed, fate = max(metric(run_dir, INFERENCE_EPISODES_DROPPED_TOTAL)), "dropped"
        assert not any(metric(run_dir, INFERENCE_EPISODES_FAILED_SCORED))
    else:
        failed, fate = sum(metric(run_dir, INFERENCE_EPISODES_FAILED_SCORED)), "scored with the failure reward"  # fmt: skip
        assert not any(metric(run_dir, INFERENCE_EPISODES_DROPPED_TOTAL))
    lines = [
        line
        for line in (run_dir / "logs" / "inference_0.log").read_text().splitlines()
        if "'anwser'" in line
    ]
    assert failed >= 16 and len(lines) <= 2, lines
    first = re.search(rf"(\d+) of the 8 episodes of a batch were {fate} because MisspeltStateEnv failed \(.*\): KeyError: 'anwser' \(at .*tools\.py", lines[0])  # fmt: skip
    assert first and int(first[1]) >= 1, lines[0]
    assert all(f"more episodes {fate} for the same reason" in line for line in lines[1:])
