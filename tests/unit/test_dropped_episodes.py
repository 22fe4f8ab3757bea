"""Episodes an environment fails: each reason named in full (`grpo.envs.dropped`), logged once
with a count by the collector, and the driver's guard that stops a run whose environment fails
nearly every episode (`grpo.orchestrator.episode_drops`)."""

from __future__ import annotations

import logging
import traceback
from types import SimpleNamespace

import pytest

from grpo.envs import Episode, MultiTurnEnv, VerifiersEnv
from grpo.envs.dropped import DroppedEpisodeLog, cause_first, scored_episodes
from grpo.errors import EnvironmentFailingError, NoInformativeGroupsError
from grpo.orchestrator.episode_drops import EpisodeDrops
from grpo.orchestrator.group_counts import GroupCounts
from grpo.rewards import MathCorrectnessReward


class TypoEnv(MultiTurnEnv):
    def env_response(self, messages, state, episode):
        return self.check(state)

    def check(self, state):
        return state["anwser"]  # the typo


def episode(error: str | None = None) -> Episode:
    result = Episode(example={"index": 0}, prompt_ids=[1], messages=[])
    result.error = error
    return result


# ---------------------------------------------------------------- the reason


def test_the_reason_names_the_exception_and_the_lines_of_the_environment_that_raised():
    dropped = episode()
    dropped.messages = [{"role": "assistant", "content": "7"}]
    TypoEnv().start_response(dropped)
    reason = dropped.error
    assert reason.startswith("KeyError: 'anwser' (at ")
    # Where it raised, then what called that: the environment's lines, not the rollout's.
    assert f"{__file__}:" in reason and 'in check: return state["anwser"]' in reason
    assert "called from" in reason and "in env_response: return self.check(state)" in reason
    assert "grpo/envs/base.py" not in reason
    assert "\n" not in reason


def test_a_long_reason_is_kept_whole_and_leads_with_its_cause():
    server_stderr = "\n".join(
        ["runtime died under harness 'tools' (exit 1): Traceback (most recent call last):"]
        + [f'  File "/srv/lib{i}.py", line {i}, in step{i}\n    step{i + 1}()' for i in range(40)]
        + ["ConnectionRefusedError: [Errno 111] Connection refused"]
    )
    assert len(server_stderr) > 1000
    reason = cause_first(f"SandboxError: {server_stderr}", name="SandboxError")
    first, _, rest = reason.partition("\n")
    assert first == "SandboxError: ... ConnectionRefusedError: [Errno 111] Connection refused"
    assert rest == f"SandboxError: {server_stderr}"
    assert cause_first("ValueError: short") == "ValueError: short"

    # A verifiers episode that failed that way: the reason is whole, and names the frame
    # its traceback ends in.
    try:
        TypoEnv().check({})
    except KeyError as error:
        formatted = "".join(traceback.format_exception(error))
    failed = SimpleNamespace(
        ok=False,
        id="t0",
        stop_condition="error",
        errors=[SimpleNamespace(type="SandboxError", message=server_stderr, traceback=formatted)],
    )
    outcome = SimpleNamespace(traces=[failed], errors=[])
    dropped = VerifiersEnv._episode(SimpleNamespace(_sampled={}), {"index": 3}, outcome)
    first, _, rest = dropped.error.partition("\n")
    assert first.startswith("the episode failed (error): SandboxError: ... ConnectionRefusedError")
    assert 'in check: return state["anwser"]' in first
    assert rest.endswith(server_stderr)


# ---------------------------------------------------------------- the collector's log


def test_each_reason_is_logged_once_with_a_count_then_counted_now_and_then(caplog):
    now = [0.0]
    drops = DroppedEpisodeLog("inference[0]", every_s=30.0, clock=lambda: now[0])
    typo = "KeyError: 'anwser' (at /x/env.py:3 in env_response: ...)"
    with caplog.at_level(logging.WARNING, logger="grpo.envs.dropped"):
        batch = drops.record([episode(typo)] * 7 + [episode()], "TypoEnv")
        for _ in range(20):  # 160 more episodes dropped within the period: no line
            now[0] += 1.0
            drops.record([episode(typo)] * 8, "TypoEnv")
        assert len(caplog.records) == 1
        now[0] += 10.0
        drops.record([episode(typo)] * 8 + [episode("ValueError: other")], "TypoEnv")
        drops.flush()
    assert (batch.episodes, batch.dropped, batch.reason, batch.reason_count) == (8, 7, typo, 7)
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == (
        "inference[0]: 7 of the 8 episodes of a batch were dropped because TypoEnv failed (later "
        f"ones for the same reason are counted in a line every 30 s): {typo}"
    )
    assert lines[1].startswith("inference[0]: 1 of the 9 episodes of a batch were dropped")
    assert lines[1].endswith("): ValueError: other")
    assert (
        lines[2]
        == f"inference[0]: 168 more episodes dropped for the same reason (175 in all): {typo}"
    )
    assert len(lines) == 3  # 176 episodes dropped, 3 lines
    assert drops.record([episode()], "TypoEnv").dropped == 0


def typo_batch(size: int) -> tuple[TypoEnv, list[Episode]]:
    """``size`` episodes of one policy turn each, on which `TypoEnv` raised."""
    env = TypoEnv(reward_functions=[MathCorrectnessReward(failure_reward=-0.5)])
    episodes = []
    for _ in range(size):
        failed = episode()
        failed.add_policy_turn([5, 6], [-0.1, -0.2])
        failed.messages.append({"role": "assistant", "content": "7"})
        env.start_response(failed)
        episodes.append(failed)
    return env, episodes


def test_failed_episodes_scored_in_their_groups_are_logged_and_stop_a_run_that_fails_them_all(
    caplog,
):
    """With ``failed_episodes: score`` the failed episodes stay, with the failure reward; the
    log says so, and the guard stops a run whose environment fails nearly every episode all
    the same."""
    env, failed = typo_batch(8)
    kept, rewards = scored_episodes(env, failed)
    assert kept == failed and rewards == [{"math_correctness": -0.5}] * 8
    drops = DroppedEpisodeLog("inference[0]")
    with caplog.at_level(logging.WARNING, logger="grpo.envs.dropped"):
        batch = drops.record(failed, "TypoEnv")
        drops.record(failed, "TypoEnv")
        drops.flush()
    assert (batch.episodes, batch.dropped, batch.scored) == (8, 8, 8)
    first, more = (record.getMessage() for record in caplog.records)
    assert first.startswith(
        "inference[0]: 8 of the 8 episodes of a batch were scored with the failure reward "
        "because TypoEnv failed (later ones"
    )
    assert "KeyError: 'anwser'" in first
    assert more.startswith("inference[0]: 8 more episodes scored with the failure reward for ")

    guard = EpisodeDrops()
    for _ in range(3):
        guard.batch(0, batch.as_dict())
    assert guard.note().startswith(
        "16 of the last 16 episodes were scored with the failure reward because the environment "
        "raised (most often: KeyError: 'anwser'"
    )
    with pytest.raises(EnvironmentFailingError) as error:
        guard.check()
    assert str(error.value).startswith(
        "the environment failed nearly every episode: 24 of the 24 episodes of the last 3 "
        "generation batches were scored with the failure reward because it raised (24 of them: "
        "KeyError: 'anwser'"
    )

    # Dropped instead: left out of their groups, counted by the same guard.
    dropping = TypoEnv(reward_functions=env.reward_functions, failed_episodes="drop")
    _, failed = typo_batch(8)
    assert scored_episodes(dropping, failed) == ([], [])
    assert not any(e.failure_scored for e in failed)
    assert DroppedEpisodeLog("inference[0]").record(failed).scored == 0


def test_reasons_that_name_each_episode_are_logged_in_full_only_up_to_a_limit(caplog):
    drops = DroppedEpisodeLog("inference[0]", max_reasons=3)
    with caplog.at_level(logging.WARNING, logger="grpo.envs.dropped"):
        batch = drops.record([episode(f"ValueError: bad answer {i}") for i in range(50)])
    assert len(caplog.records) == 4  # three reasons in full, then the rest together
    other = caplog.records[-1].getMessage()
    assert other.startswith("inference[0]: 47 of the 50 episodes of a batch were dropped")
    assert other.endswith(f"): {DroppedEpisodeLog.OTHER_REASONS}")
    assert drops.totals[DroppedEpisodeLog.OTHER_REASONS] == 47
    assert (batch.episodes, batch.dropped) == (50, 50)


# ---------------------------------------------------------------- the driver's guard


def batch(episodes: int, dropped: int, reason: str = "KeyError: 'anwser'") -> dict:
    return {
        "episodes": episodes,
        "dropped": dropped,
        "reason": reason if dropped else None,
        "reason_count": dropped,
    }


def test_guard_stops_once_nearly_every_episode_of_three_batches_was_dropped():
    guard = EpisodeDrops(lambda index: f" (its output: logs/inference_{index}.log)")
    guard.batch(0, None)  # a batch without an environment says nothing
    guard.batch(0, batch(8, 8))
    guard.batch(1, batch(8, 7))
    guard.check()  # two batches: not yet
    guard.batch(1, batch(8, 8))
    with pytest.raises(EnvironmentFailingError) as error:
        guard.check()
    message = str(error.value)
    assert message.startswith(
        "the environment failed nearly every episode: 23 of the 24 episodes of the last 3 "
        "generation batches were dropped because it raised (23 of them: KeyError: 'anwser')"
    )
    assert "(its output: logs/inference_1.log)" in message  # the collector that saw it most

    # An environment failing a third of its episodes goes on; so do too few episodes.
    flaky = EpisodeDrops()
    for _ in range(10):
        flaky.batch(0, batch(8, 3))
    flaky.check()
    few = EpisodeDrops()
    for _ in range(3):
        few.batch(0, batch(4, 4))
    few.check()  # 12 episodes: below the 16 a decision needs
    few.batch(0, batch(4, 4))
    with pytest.raises(EnvironmentFailingError, match="16 of the 16 episodes of the last 4"):
        few.check()
    # Batches that get through again end it: the newest batches decide.
    recovered = EpisodeDrops()
    for dropped in (8, 8, 8, 0, 0, 0):
        recovered.batch(0, batch(8, dropped))
    recovered.check()


def test_a_long_reason_is_whole_in_the_error_and_its_cause_in_the_first_line():
    guard = EpisodeDrops()
    reason = "SandboxError: ... ConnectionRefusedError: refused\nSandboxError: died:\n  File x"
    for _ in range(3):
        guard.batch(0, batch(8, 8, reason))
    with pytest.raises(EnvironmentFailingError) as error:
        guard.check()
    first, _, rest = str(error.value).partition("\n")
    assert "(24 of them: SandboxError: ... ConnectionRefusedError: refused)" in first
    assert rest == "The reason in full:\nSandboxError: died:\n  File x"


def test_equal_rewards_of_mostly_dropped_episodes_blame_the_environment(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("grpo.orchestrator.group_counts.time.monotonic", lambda: now[0])
    drops = EpisodeDrops(lambda index: f" (its output: logs/inference_{index}.log)")
    counts = GroupCounts(filtering=True, timeout_s=10.0, causes=[drops])
    drops.batch(0, batch(8, 6))
    counts.scored(2, num_zero_variance=2, num_dropped=2)
    now[0] = 111.0
    with pytest.raises(NoInformativeGroupsError) as error:
        counts.check(waiting_since=100.0)
    message = str(error.value)
    assert "6 of the last 8 episodes were dropped because the environment raised" in message
    assert "KeyError: 'anwser'" in message and "logs/inference_0.log" in message
    assert "temperature" not in message
    # Few dropped episodes: the rewards are the cause, as before.
    drops.batch(0, batch(32, 1))
    with pytest.raises(NoInformativeGroupsError, match="inference.temperature"):
        counts.check(waiting_since=100.0)
