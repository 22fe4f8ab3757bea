"""reasoning-gym as an environment: its tasks checked before the run, its rows generated
(deterministic, train and held-out disjoint), its scorer on the responses, per-task rewards,
and a short run on two tasks.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_reasoning_gym.py.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("reasoning_gym", reason='the hub extra: pip install -e ".[hub]"')

from grpo.envs import Episode, ReasoningGymEnv  # noqa: E402
from grpo.envs.metrics import episode_metrics  # noqa: E402
from grpo.envs.preflight import environment_problems  # noqa: E402
from grpo.envs.reasoning_gym import INSTALL_HINT, task_problems  # noqa: E402
from grpo.rewards.reasoning_gym import ReasoningGymReward  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
TASKS = {"chain_sum": 1.0, "basic_arithmetic": {"weight": 3.0, "config": SMALL}}


def env(**options) -> ReasoningGymEnv:
    return ReasoningGymEnv(**{"tasks": TASKS, "size": 200, "eval_size": 40, **options})


# ---------------------------------------------------------------------------------- the tasks


def test_an_unknown_task_is_one_line_naming_its_key_and_the_closest_task():
    problems = environment_problems(
        "environment",
        {"_component_": "grpo.envs.ReasoningGymEnv", "tasks": {"chain_sumx": 1.0, "chain_sum": 1}},
    )
    assert problems == [
        "environment.tasks.chain_sumx: reasoning-gym has no task 'chain_sumx'; "
        "did you mean chain_sum?"
    ]


def test_bad_weights_and_configs_are_named_by_their_task():
    problems = task_problems(
        {
            "chain_sum": {"weight": 0},
            "basic_arithmetic": {"config": {"no_such_option": 1}},
            "leg_counting": -1.0,
            "spell_backward": {"weigth": 1.0},
        },
        "environment.tasks",
    )
    assert len(problems) == 4
    assert problems[0] == "environment.tasks.chain_sum: weight: expected a number > 0, got 0"
    assert problems[1].startswith("environment.tasks.basic_arithmetic.config: ")
    assert "no_such_option" in problems[1]
    assert problems[2] == "environment.tasks.leg_counting: expected a weight > 0, got -1.0"
    assert "unknown key(s) ['weigth']" in problems[3]
    with pytest.raises(ValueError, match="did you mean chain_sum"):
        ReasoningGymEnv(tasks={"chain_sumx": 1.0})


def test_grpo_validate_refuses_a_misspelled_task_in_one_line(tiny_model_dir, tmp_path, capsys):
    from grpo.cli import main as grpo_main

    base = [
        "validate",
        "tiny_reasoning_gym_cpu",
        f"base_model_path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
    ]
    assert grpo_main(base) == 0
    capsys.readouterr()
    assert grpo_main([*base, "environment.tasks={chain_sumx: 1.0}"]) != 0
    err = capsys.readouterr().err
    assert "environment.tasks.chain_sumx: reasoning-gym has no task 'chain_sumx'; did you mean chain_sum?" in err  # fmt: skip
    assert "config has" not in err  # the one problem
    assert grpo_main([*base, "dataset={_component_: grpo.data.arithmetic_dataset}"]) != 0
    assert "ReasoningGymEnv generates its own tasks" in capsys.readouterr().err


def test_without_reasoning_gym_the_one_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    assert task_problems({"chain_sum": 1.0}, "environment.tasks") == [
        f"environment.tasks: {INSTALL_HINT}"
    ]
    assert 'pip install -e ".[hub]"' in INSTALL_HINT


# ---------------------------------------------------------------------------------- the rows


def test_rows_are_deterministic_per_seed_and_held_out_rows_are_disjoint():
    first, again, other = env(seed=0), env(seed=0), env(seed=1)
    train, held_out = first.examples(), first.eval_examples()
    assert len(train) == 200 and len(held_out) == 40
    assert list(train) == list(again.examples())
    assert list(held_out) == list(again.eval_examples())
    assert [r["question"] for r in train] != [r["question"] for r in other.examples()]
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    # Every row has its task; the tasks are interleaved in proportion to their weights.
    for split in (train, held_out):
        assert {row["task"] for row in split} == {"chain_sum", "basic_arithmetic"}
        assert set(split[0]) == {"index", "question", "answer", "task", "metadata", "prompt"}
    assert sum(row["task"] == "basic_arithmetic" for row in train) == 150
    assert [row["index"] for row in train] == list(range(200))
    assert train[0]["prompt"] == train[0]["question"] + "\n"  # the default template
    assert train.template.stop == ("</answer>",)


def test_the_prompt_is_rendered_with_the_template_given():
    from grpo.data import ThinkAnswerTemplate

    rows = env(template=ThinkAnswerTemplate()).examples()
    assert rows[0]["prompt"] == ThinkAnswerTemplate()(rows[0]["question"])
    assert isinstance(rows.template, ThinkAnswerTemplate)
    with pytest.raises(ValueError, match="template: expected a template node"):
        env(template="answer_only")


def test_a_task_config_reaches_its_rows():
    rows = env().examples()
    for row in rows:
        if row["task"] == "basic_arithmetic":
            assert row["metadata"]["num_terms"] == 2 and row["metadata"]["num_digits"] <= 2


def test_a_task_too_small_for_its_held_out_rows_is_refused():
    tiny = {"chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}
    with pytest.raises(ValueError, match="too few distinct questions"):
        ReasoningGymEnv(tasks=tiny, size=100, eval_size=4000).examples()


# ---------------------------------------------------------------------------------- scoring


def episode(row: dict, response: str) -> Episode:
    return Episode(
        example=dict(row),
        prompt_ids=[1],
        messages=[{"role": "user", "content": row["question"]}, {"role": "assistant", "content": response}],
    )  # fmt: skip


def test_responses_are_scored_by_reasoning_gyms_scorer_with_per_task_metrics():
    environment = env(reward_timeout_s=30.0)
    rows = environment.examples()
    chain = next(row for row in rows if row["task"] == "chain_sum")
    arithmetic = next(row for row in rows if row["task"] == "basic_arithmetic")
    episodes = [
        episode(chain, f"<think>sum</think> <answer>{chain['answer']}</answer>"),
        episode(chain, f"<answer>{int(chain['answer']) + 1}</answer>"),
        episode(arithmetic, f"<answer> {arithmetic['answer']} </answer>"),
        episode(arithmetic, arithmetic["answer"]),  # no <answer> block: nothing extracted
    ]
    rewards = environment.score(episodes)
    assert [r["reasoning_gym"] for r in rewards] == [1.0, 0.0, 1.0, 0.0]
    assert environment.reward_names() == ["reasoning_gym"]
    assert [e.successes for e in episodes][0] == {"reasoning_gym": 1.0}
    metrics = episode_metrics(episodes, 0, 0.0)
    assert metrics["inference/env_chain_sum_reward"] == 0.5
    assert metrics["inference/env_basic_arithmetic_reward"] == 0.5
    assert environment.take_reward_calls()["reasoning_gym"]["calls"] == 4


def test_the_scorer_is_the_tasks_own():
    reward = ReasoningGymReward()
    # ProceduralDataset's default scorer gives partial credit when the answer contains it.
    assert reward("<answer>x6</answer>", "6", task="chain_sum").reward == 0.5
    with pytest.raises(ValueError, match="'task' column"):
        reward("<answer>6</answer>", "6")
