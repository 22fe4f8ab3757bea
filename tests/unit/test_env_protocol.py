"""One protocol for every kind of episode: the single-turn case is an environment like any other.

The engine is scripted (a unit test of the logic around it); the real engine runs the same
path in tests/integration/test_collector.py and the run-level tests.
"""

import pytest

from grpo.config import ConfigError
from grpo.envs import (
    AgentEnv,
    EngineContext,
    Environment,
    EpisodeLimits,
    MultiTurnEnv,
    Sample,
    SingleTurnEnv,
    ToolEnv,
    VerifiersEnv,
    build_environment,
    episode_groups,
)
from grpo.envs.preflight import brings_held_out_rows, data_problems, environment_class
from grpo.envs.reasoning_gym import ReasoningGymEnv
from grpo.models import load_tokenizer
from grpo.rewards import MathCorrectnessReward, reward_function
from grpo.testing.tools import EchoUserEnv


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _context(tokenizer, max_model_len=256, per_turn=16):
    return EngineContext(
        model_dir=str(tokenizer.model_dir),
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        max_tokens_per_turn=per_turn,
    )


def test_every_kind_of_episode_implements_the_one_protocol():
    for kind in (SingleTurnEnv, MultiTurnEnv, ToolEnv, VerifiersEnv):
        assert issubclass(kind, Environment), kind
    assert Environment.__abstractmethods__ == {"run_groups", "score"}


def test_episode_limits_bound_a_turn_by_the_turn_the_episode_and_the_context():
    limits = EpisodeLimits(
        max_turns=3, max_tokens_per_turn=10, max_model_len=50, max_episode_tokens=25
    )
    assert limits.turn_tokens(prompt_len=20, response_len=0) == 10
    assert limits.turn_tokens(prompt_len=20, response_len=20) == 5  # the episode's budget
    assert limits.turn_tokens(prompt_len=45, response_len=0) == 5  # the context
    assert limits.turn_tokens(prompt_len=20, response_len=0, asked=4) == 4  # a client's ask
    assert limits.turn_tokens(prompt_len=60, response_len=0) == 0  # nothing fits


def test_without_an_environment_node_the_run_gets_the_single_turn_environment():
    env = build_environment(None, [{"_component_": "grpo.rewards.MathCorrectnessReward"}], 3.0)
    assert isinstance(env, SingleTurnEnv)
    assert env.reward_names() == ["math_correctness"]
    assert env.reward_timeout_s == 3.0 and env.max_turns == 1
    assert env.examples() is None and env.response_budget(64) == 64
    node = {"_component_": "grpo.testing.tools.EchoUserEnv", "max_turns": 2}
    built = build_environment(node, [MathCorrectnessReward()], 5.0)
    assert isinstance(built, EchoUserEnv) and built.reward_names() == ["math_correctness"]
    with pytest.raises(ConfigError, match="environment"):
        build_environment({**node, "max_turns": 0}, [], 5.0)
    with pytest.raises(TypeError, match="not a grpo.envs.Environment"):
        build_environment(object(), [], 5.0)


def _scripted(tokenizer, texts_by_seed):
    """A batch engine that answers each request with the text of its seed, and says which
    weights sampled it (two runs: version 3 then 4)."""

    def sample(requests):
        samples = []
        for request in requests:
            ids = tokenizer.encode(texts_by_seed(request.seed), add_bos=False, add_eos=False)
            ids = ids[: request.max_tokens] + [tokenizer.eos_id]
            samples.append(Sample(ids, [-0.25] * len(ids), "stop", ((3, 1), (4, len(ids) - 1))))
        return samples

    return sample


def test_a_single_turn_group_is_one_scored_response_per_seed_of_the_group(tokenizer):
    env = SingleTurnEnv([MathCorrectnessReward()], reward_timeout_s=5.0)
    env.start(_context(tokenizer))
    example = {"question": "1 + 6?", "answer": "7", "prompt": "What is 1 + 6?", "index": 0}
    prompt_ids = env.prompt_ids(example)
    assert prompt_ids == tokenizer.encode("What is 1 + 6?", add_bos=True, add_eos=False)
    # Episode j of the group samples with the group's seed + j, as vLLM seeds n samples.
    engine = _scripted(tokenizer, lambda seed: "<answer>7</answer>" if seed % 2 else "8")
    [group] = env.run_groups([(example, prompt_ids)], engine, group_size=4, seeds=[100])
    assert len(group) == 4 and all(e.num_turns == 1 and e.env_tokens == 0 for e in group)
    assert not any(e.hit_max_turns or e.truncated for e in group)  # one turn is no limit hit
    rewards = env.score(group)
    assert [r["math_correctness"] for r in rewards] == [0.0, 1.0, 0.0, 1.0]
    assert [e.successes["math_correctness"] for e in group] == [0.0, 1.0, 0.0, 1.0]

    [trajectories] = episode_groups(
        [group],
        rewards,
        group_ids=[5],
        sequence_id=iter(["a", "b", "c", "d"]).__next__,
        policy_version=0,
    )
    first = trajectories.trajectories[0]
    # Versions come from the tokens' runs, not from the caller's default.
    assert (first.policy_version, first.last_policy_version) == (3, 4)
    assert first.env_successes == {"math_correctness": 0.0}
    assert first.prompt_tokens.tolist() == prompt_ids


def boom(completion: str, answer: str) -> float:
    raise RuntimeError("no")


def test_reward_failures_are_counted_by_the_environment(tokenizer):
    env = SingleTurnEnv([reward_function(boom)], reward_timeout_s=5.0)
    env.start(_context(tokenizer))
    example = {"question": "q", "answer": "7", "prompt": "q", "index": 0}
    engine = _scripted(tokenizer, lambda seed: "7")
    [group] = env.run_groups([(example, env.prompt_ids(example))], engine, 2, seeds=[0])
    env.score(group)
    assert env.batch_metrics() == {"inference/reward_failures_func_boom": 2.0}


def test_an_environment_must_be_started_before_its_episodes(tokenizer):
    env = SingleTurnEnv([MathCorrectnessReward()])
    with pytest.raises(RuntimeError, match="start must be called"):
        env.prompt_ids({"prompt": "q"})
    env.start(_context(tokenizer))
    with pytest.raises(KeyError, match="no 'prompt'"):
        env.prompt_ids({"question": "q", "index": 3})


def test_rewards_are_computed_while_the_episodes_run_and_score_collects_them(tokenizer):
    env = SingleTurnEnv([MathCorrectnessReward()], reward_timeout_s=5.0)
    env.start(_context(tokenizer))
    scored_now = []
    score_now = env._score_now
    env._score_now = lambda episodes: scored_now.append(len(episodes)) or score_now(episodes)
    example = {"question": "1 + 6?", "answer": "7", "prompt": "What is 1 + 6?", "index": 0}
    engine = _scripted(tokenizer, lambda seed: "<answer>7</answer>" if seed % 2 else "8")
    [group] = env.run_groups([(example, env.prompt_ids(example))], engine, 4, seeds=[100])
    assert sum(scored_now) == 4  # every episode scored by the time run_groups returns
    assert [r["math_correctness"] for r in env.score(group)] == [0.0, 1.0, 0.0, 1.0]
    assert sum(scored_now) == 4  # score only collected them
    # Episodes it did not see (or a second call) are scored when asked.
    assert [r["math_correctness"] for r in env.score(group[:2])] == [0.0, 1.0]
    assert sum(scored_now) == 6


# ------------------------------------------------------- what an environment brings to the config


class _OwnGym(ReasoningGymEnv):
    """A user's subclass at a path of its own: it brings what its base brings."""


_PATHS = {"my.OwnGym": _OwnGym, "my.Tools": ToolEnv, "my.Agent": AgentEnv}


def _data_problems(node, **values):
    values.setdefault("dataset", {"_component_": "grpo.data.arithmetic_dataset"})
    values.setdefault("reward_functions", [{"_component_": "grpo.rewards.MathCorrectnessReward"}])
    locate = _PATHS.get if node["_component_"] in _PATHS else None
    return data_problems({"environment": node, **values}, locate)


def test_an_environment_class_says_what_the_run_must_give():
    own = {"_component_": "my.OwnGym", "tasks": {"chain_sum": 1.0}}
    assert _data_problems(own, dataset=None, eval_every_n_steps=5) == []
    assert brings_held_out_rows(own, _PATHS.get)
    [problem] = _data_problems(own)
    assert problem.startswith("dataset: environment._component_ my.OwnGym generates its own tasks")
    [problem] = _data_problems({**own, "eval_size": 0}, dataset=None, eval_every_n_steps=5)
    assert problem.startswith("eval_every_n_steps: set, but environment.eval_size is 0")
    assert not brings_held_out_rows({**own, "eval_size": 0}, _PATHS.get)

    tools = {"_component_": "my.Tools", "tools": ["grpo.envs.calculator"]}
    [problem] = _data_problems(tools, dataset=None)
    assert problem.startswith("dataset: required key is missing (environment._component_ my.Tools")
    assert _data_problems(tools, eval_every_n_steps=5) == [
        "eval_every_n_steps: set, but eval_dataset is null"
    ]
    [problem] = _data_problems(tools, reward_functions=[])
    assert problem.startswith("reward_functions: empty, but environment._component_ my.Tools")
    assert _data_problems({"_component_": "my.Agent", "agent": "a.b"}, reward_functions=[]) == []

    # A factory's class is its return annotation: verifiers_env builds a VerifiersEnv, whose
    # taskset brings the tasks and scores them, with no held-out split.
    verifiers = {"_component_": "grpo.envs.verifiers_env", "taskset": "my_tasks"}
    assert environment_class(verifiers) is VerifiersEnv
    assert _data_problems(verifiers, dataset=None, reward_functions=[]) == []
    [problem] = _data_problems(verifiers, dataset=None, eval_every_n_steps=5, eval_dataset={})
    assert problem.startswith("eval_every_n_steps: held-out evaluation scores eval_dataset's")
    # What does not import is the component check's to report.
    assert _data_problems({"_component_": "my.Missing"}, dataset=None) == []
