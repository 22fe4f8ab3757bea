"""TextArena as an environment: a real game played turn by turn (legal and illegal moves, the
end of the game and its reward), one game object per episode, the game checked before the
run, and a short run of the tiny config.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_textarena.py.
"""

from __future__ import annotations

import random
import sys

import pytest

pytest.importorskip("textarena", reason='the hub extra: pip install -e ".[hub]"')

from grpo.envs import Episode, TextArenaEnv  # noqa: E402
from grpo.envs.metrics import episode_metrics  # noqa: E402
from grpo.envs.preflight import environment_problems  # noqa: E402
from grpo.envs.textarena_env import INSTALL_HINT, game_problems  # noqa: E402

GAME = "GuessTheNumber-v0"


def env(**options) -> TextArenaEnv:
    return TextArenaEnv(**{"game": GAME, "size": 20, "eval_size": 4, **options})


def start(environment: TextArenaEnv, row: dict) -> Episode:
    return Episode(
        example=dict(row),
        prompt_ids=[1],
        messages=[{"role": "user", "content": row["question"]}],
        state=environment.reset(row),
    )


def play(environment: TextArenaEnv, episode: Episode, action: str):
    episode.messages.append({"role": "assistant", "content": action})
    answer = environment.env_response(episode.messages, episode.state, episode)
    if answer is not None:
        episode.messages += answer
    return answer


def target(episode: Episode) -> int:
    return episode.state["game"].env.state.game_state["game_number"]


# ---------------------------------------------------------------------------------- the game


def test_rows_are_game_seeds_with_the_first_observation_and_held_out_seeds_apart():
    environment = env()
    train, held_out = environment.examples(), environment.eval_examples()
    assert len(train) == 20 and len(held_out) == 4
    row = train[0]
    assert set(row) == {"game", "seed", "question", "answer", "index", "prompt"}
    assert row["game"] == GAME and row["answer"] == ""
    assert "Guess The Number" in row["question"] and row["prompt"] == row["question"] + "\n"
    assert not {r["seed"] for r in train} & {r["seed"] for r in held_out}
    assert [r["seed"] for r in train] == [r["seed"] for r in env().examples()]
    assert [r["seed"] for r in train] != [r["seed"] for r in env(seed=1).examples()]
    assert environment.stop == ("]",)


def test_a_game_played_to_its_end_scores_the_games_reward():
    environment = env()
    episode = start(environment, environment.examples()[3])
    number = target(episode)
    low = 1 if number != 1 else 2
    hint = play(environment, episode, f"I guess [{low}]")
    assert hint == [{"role": "user", "content": f"The target number is {'higher' if low < number else 'lower'}."}]  # fmt: skip
    # An illegal move: the game says so and the episode goes on (one error is allowed).
    (notice,) = play(environment, episode, "no number here")
    assert notice["role"] == "user" and "invalid move" in notice["content"]
    assert play(environment, episode, f"[{number}]") is None  # won: the episode ends
    assert "game" not in episode.state  # the game object is let go
    assert episode.state["won"] and episode.state["reward"] == 1.0
    (reward,) = environment.score([episode])
    assert reward == {"textarena": 1.0}
    assert episode.successes == {"textarena": 1.0}
    assert environment.reward_names() == ["textarena"]


def test_a_second_illegal_move_loses_and_an_unfinished_game_scores_zero():
    environment = env()
    rows = environment.examples()
    lost = start(environment, rows[0])
    play(environment, lost, "nothing")
    assert play(environment, lost, "still nothing") is None  # the game's own rule: it ends
    unfinished = start(environment, rows[1])
    play(environment, unfinished, "[1]" if target(unfinished) != 1 else "[2]")
    rewards = environment.score([lost, unfinished])
    assert rewards == [{"textarena": 0.0}, {"textarena": 0.0}]
    assert not lost.state["won"] and lost.state["reason"].startswith("Invalid Move")
    assert unfinished.state["reason"] == "unfinished"
    metrics = episode_metrics([lost, unfinished], 0, 0.0)
    assert metrics["inference/env_textarena_finished"] == 0.5
    assert metrics["inference/env_textarena_invalid_move"] == 0.5


def test_each_episode_has_its_own_game_and_the_process_random_is_left_alone():
    environment = env()
    row = environment.examples()[5]
    random.seed(7)
    expected = random.random()
    random.seed(7)
    first, second = start(environment, row), start(environment, row)
    assert random.random() == expected  # seeding a game left the global random alone
    assert first.state["game"] is not second.state["game"]
    assert first.state["game"].env is not second.state["game"].env
    assert target(first) == target(second)  # the same seed, the same game
    number = target(first)
    play(environment, first, f"[{number}]")
    assert first.state["won"]
    assert "game" in second.state and not second.state["game"].done  # untouched
    assert play(environment, second, f"[{number}]") is None and second.state["won"]


def test_reward_functions_are_scored_beside_the_games_reward():
    from grpo.rewards import TokenPresenceReward

    environment = env(reward_functions=[TokenPresenceReward(token="]", name="bracketed")])
    episode = start(environment, environment.examples()[0])
    play(environment, episode, "[1]" if target(episode) != 1 else "[2]")
    (reward,) = environment.score([episode])
    assert reward == {"textarena": 0.0, "bracketed": 1.0}
    assert environment.reward_names() == ["textarena", "bracketed"]
    assert environment.failure_rewards() == {"textarena": 0.0, "bracketed": 0.0}


# ---------------------------------------------------------------------------------- checks


def test_an_unknown_game_is_one_line_naming_its_key_and_the_closest_game():
    problems = environment_problems(
        "environment", {"_component_": "grpo.envs.TextArenaEnv", "game": "GuessTheNumbr-v0"}
    )
    assert problems == [
        "environment.game: TextArena has no game 'GuessTheNumbr-v0'; "
        "did you mean GuessTheNumber-v0?"
    ]
    with pytest.raises(ValueError, match="did you mean GuessTheNumber-v0"):
        TextArenaEnv(game="GuessTheNumbr-v0")


def test_grpo_validate_refuses_a_misspelled_game_in_one_line(tiny_model_dir, tmp_path, capsys):
    from grpo.cli import main as grpo_main

    base = [
        "validate",
        "tiny_textarena_cpu",
        f"base_model_path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
    ]
    assert grpo_main(base) == 0
    capsys.readouterr()
    assert grpo_main([*base, "environment.game=GuessTheNumbr-v0"]) != 0
    err = capsys.readouterr().err
    assert "environment.game: TextArena has no game 'GuessTheNumbr-v0'; did you mean GuessTheNumber-v0?" in err  # fmt: skip
    assert grpo_main([*base, "dataset={_component_: grpo.data.arithmetic_dataset}"]) != 0
    assert "TextArenaEnv generates its own tasks" in capsys.readouterr().err


def test_without_textarena_the_one_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # import raises ImportError
    assert game_problems(GAME, "environment.game") == [f"environment.game: {INSTALL_HINT}"]
    assert 'pip install -e ".[hub]"' in INSTALL_HINT
