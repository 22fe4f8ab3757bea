"""Held-out evaluation: pass@k, episodes through the environment protocol, and ``grpo eval``.

The engine is scripted here (as in tests/unit/test_envs.py): each policy turn samples the next text
of a script, so which samples succeed is known. The last test runs ``grpo eval`` for real on
the tiny demo model.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_evaluation.py.
"""

from __future__ import annotations

import itertools
import re
from math import comb

import pytest

from grpo.config import load_config
from grpo.config.validation import check_config
from grpo.envs import Sample, SingleTurnEnv
from grpo.envs.evaluation import EvaluationEnvironment, evaluation_episodes
from grpo.envs.protocol import EngineContext
from grpo.models import load_tokenizer
from grpo.orchestrator.evaluation import HeldOutEvaluator, evaluation_metrics, pass_at_k
from grpo.rewards import FormatReward, MathCorrectnessReward
from grpo.testing.tools import EchoUserEnv


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (c of them successful) holding a success."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_success(n):
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k)), (n, c, k)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0
    assert comb(n, 1) == n  # pass@1 is c / n
    assert all(pass_at_k(n, c, 1) == pytest.approx(c / n) for c in range(n + 1))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(2, 3, 1), (2, 1, 3), (2, 1, 0), (2, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


class ScriptedSampler:
    """Each policy turn of example i (its prompt reads ``Question i?``) samples the next text of
    ``script[i]``, cycling, closed by a stop token."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = {i: itertools.cycle(texts) for i, texts in script.items()}

    def __call__(self, requests):
        samples = []
        for request in requests:
            prompt = self.tokenizer.decode(request.token_ids)
            index = int(re.search(r"Question (\d+)\?", prompt).group(1))
            ids = self.tokenizer.encode(next(self.script[index]), add_bos=False, add_eos=False)
            ids = [*ids, self.tokenizer.eos_id][: request.max_tokens]
            samples.append(Sample(ids, [-0.5] * len(ids), "stop"))
        return samples


class FakeCollector:
    """A collector's `evaluate_episodes` on a started environment and a scripted sampler."""

    def __init__(self, env, sampler):
        self.env, self.sampler, self.calls = env, sampler, []

    def evaluate_episodes(self, items, samples_per_example, temperature, max_generated_tokens):
        self.calls.append((samples_per_example, temperature, max_generated_tokens))
        prompt_ids = [self.env.prompt_ids(item) for item in items]
        return evaluation_episodes(
            self.env, self.sampler, items, prompt_ids, samples_per_example, 0
        )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _context(tokenizer, model_dir):
    return EngineContext(str(model_dir), tokenizer, max_model_len=512, max_tokens_per_turn=32)


def _items(tokenizer, tasks):
    return [
        {"index": i, "question": f"q{i}", "prompt": f"Question {i}?", "answer": "7", "task": task}
        for i, task in enumerate(tasks)
    ]


def test_single_turn_evaluation_scores_with_the_runs_reward_functions(tokenizer, tiny_model_dir):
    env = SingleTurnEnv([MathCorrectnessReward(), FormatReward(think_required=False)])
    env.start(_context(tokenizer, tiny_model_dir))
    # Two samples per example: example 0 answers (right, wrong), example 1 (wrong, wrong),
    # example 2 (right, right), each well formed.
    right, wrong = "<answer>7</answer>", "<answer>3</answer>"
    script = {0: [right, wrong], 1: [wrong], 2: [right]}
    collector = FakeCollector(env, ScriptedSampler(tokenizer, script))
    evaluator = HeldOutEvaluator(
        _items(tokenizer, ["add", "add", "mul"]),
        collector,
        max_generated_tokens=16,
        samples_per_example=2,
        temperature=1.0,
    )
    metrics = evaluator(step=3)
    assert collector.calls == [(2, 1.0, 16)]
    assert metrics["eval/accuracy"] == pytest.approx(3 / 6)
    assert metrics["eval/avg@2"] == pytest.approx((1 / 2 + 0 + 1) / 3)
    assert metrics["eval/pass@2"] == pytest.approx(2 / 3)
    assert metrics["eval/pass@2"] >= metrics["eval/avg@2"]
    assert metrics["eval/task_add/avg@2"] == pytest.approx(1 / 4)
    assert metrics["eval/task_add/pass@2"] == pytest.approx(1 / 2)
    assert metrics["eval/task_mul/pass@2"] == pytest.approx(1.0)
    assert metrics["eval/reward_math_correctness_mean"] == pytest.approx(3 / 6)
    assert metrics["eval/success_format_mean"] == pytest.approx(1.0)
    assert metrics["eval/num_examples"] == 3 and metrics["eval/samples_per_example"] == 2
    assert metrics["eval/failed_episodes"] == 0
    assert metrics["eval/response_tokens_mean"] > 1
    assert [len(r["samples"]) for r in evaluator.results] == [2, 2, 2]


def test_multi_turn_evaluation_plays_every_turn_and_counts_failed_episodes(
    tokenizer, tiny_model_dir
):
    # Two turns per episode; the environment raises at turn 1 on examples with an even index.
    env = EchoUserEnv(max_turns=2, raise_on_turn=1, reward_functions=[MathCorrectnessReward()])
    env.start(_context(tokenizer, tiny_model_dir))
    turns = ["thinking", "<answer>7</answer>"]
    sampler = ScriptedSampler(tokenizer, dict.fromkeys((1, 2, 3), turns))
    items = [
        {"index": i, "question": "q", "prompt": f"Question {i}?", "answer": "7"} for i in (1, 2, 3)
    ]
    metrics = HeldOutEvaluator(items, FakeCollector(env, sampler))(step=0)
    # Examples 1 and 3 answer right on their second turn; example 2's episode failed.
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/avg@1"] == metrics["eval/pass@1"] == pytest.approx(2 / 3)
    assert metrics["eval/failed_episodes"] == 1
    assert not any(key.startswith("eval/task_") for key in metrics)


def test_evaluation_counts_nothing_in_the_training_environment(tokenizer, tiny_model_dir):
    training = SingleTurnEnv([MathCorrectnessReward()])
    training.start(_context(tokenizer, tiny_model_dir))
    evaluation = EvaluationEnvironment(None, [MathCorrectnessReward()], 10.0, training)
    env = evaluation.get()
    assert env is not training and env is evaluation.get() and env.context is training.context
    collector = FakeCollector(env, ScriptedSampler(tokenizer, {0: ["<answer>7</answer>"]}))
    HeldOutEvaluator(_items(tokenizer, [None]), collector)(step=0)
    assert training.take_reward_calls() == {} and training.reward_failures == {}
    assert env.take_reward_calls()  # the evaluation instance scored
    evaluation.close()


def test_metrics_of_an_environment_with_its_own_score_count_a_positive_reward_as_success():
    results = [
        {"task": None, "samples": [{"rewards": {"r": 0.5}, "successes": {"r": 1.0},
                                    "response_tokens": 4, "failed": False}]},
        {"task": None, "samples": [{"rewards": {}, "successes": {}, "response_tokens": 0,
                                    "failed": True}]},
    ]  # fmt: skip
    metrics = evaluation_metrics(results, 1)
    assert metrics["eval/accuracy"] == 0.5 and metrics["eval/reward_r_mean"] == 0.25
    assert metrics["eval/response_tokens_mean"] == 4


def test_validate_refuses_several_greedy_samples():
    values = load_config("tiny_arithmetic_cpu").model_dump()
    problems = check_config(
        {**values, "eval_samples_per_example": 4}, check_components=False
    ).problems
    assert [p for p in problems if p.startswith("eval_samples_per_example: 4 samples")]
    ok = {**values, "eval_samples_per_example": 4, "eval_temperature": 1.0}
    assert not check_config(ok, check_components=False).problems
