"""Tests for reward functions, batched scoring with timeouts, and group advantages.

Reward functions as users write them (plain per-sample ones, TRL's batched ones, ones that take
the example's columns) score as written, ``grpo validate`` and the run accept and refuse the
same nodes, and a run whose reward fails every call stops, naming the error and its line.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_rewards.py.
"""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest
import torch

from grpo.objective.advantages import group_advantages
from grpo.rewards import (
    FormatReward,
    MathCorrectnessReward,
    RewardBatch,
    RewardPool,
    RewardResult,
    TokenPresenceReward,
    batched_rewards,
    extract_answer,
    reward_function,
    total_reward,
)
from tests.helpers.rewards import (
    CrashingReward,
    RaisingReward,
    SleepyReward,
    SlowReward,
    SpinningReward,
    UnloadableReward,
    has_digit_reward,
)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2) as reward_pool:
        yield reward_pool


# ---------------------------------------------------------------------------------------------
# Math correctness
# ---------------------------------------------------------------------------------------------

MATH_CASES = [
    # (completion, gold, allow_last_number, reward, success)
    ("<think>5*17</think><answer>85</answer>", "85", True, 1.0, True),
    ("so the total is \\boxed{85}.", "85", True, 1.0, True),
    ("The answer is 85.", "85", True, 1.0, True),
    ("The answer is 85.", "85", False, 0.0, False),
    ("First 12 apples, then 85", "85", True, 1.0, True),
    ("<answer>85.0</answer>", "85", True, 1.0, True),
    ("<answer>1234</answer>", "1,234", True, 1.0, True),
    ("<answer>1,234</answer>", "1234", True, 1.0, True),
    ("<answer>72</answer>", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", True, 1.0, True),
    ("<answer>\\frac{1}{2}</answer>", "0.5", True, 1.0, True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True, 1.0, True),
    ("<answer>-3</answer>", "-3", True, 1.0, True),
    ("<answer>86</answer>", "85", True, 0.1, False),
    ("<answer>12</answer> wait, <answer>85</answer>", "85", True, 1.0, True),
    ("<answer>85</answer> wait, <answer>12</answer>", "85", True, 0.1, False),
    ("<answer>85</answer> and later \\boxed{3}", "85", True, 1.0, True),
    ("", "85", True, 0.0, False),
    ("I do not know", "85", True, 0.0, False),
    ("<answer>banana</answer>", "85", False, 0.0, False),
]


@pytest.mark.parametrize("completion, gold, allow_last_number, reward, success", MATH_CASES)
def test_math_correctness_table(completion, gold, allow_last_number, reward, success):
    reward_fn = MathCorrectnessReward(partial_credit=0.1, allow_last_number=allow_last_number)
    result = reward_fn(completion, gold)
    assert isinstance(result, RewardResult)
    assert result.reward == pytest.approx(reward)
    assert result.success is success


def test_math_correctness_defaults_and_unparsable_gold():
    reward_fn = MathCorrectnessReward()
    assert reward_fn.name == "math_correctness"
    assert reward_fn("<answer>86</answer>", "85") == (0.0, False)  # partial credit defaults to 0
    # Strict format by default: a last number that happens to match earns nothing untagged.
    assert reward_fn("I think it is 85", "85") == (0.0, False)
    assert reward_fn("\\boxed{85}", "85") == (1.0, True)
    with pytest.raises(ValueError, match="gold answer"):
        reward_fn("<answer>85</answer>", "not a number")


def test_math_correctness_parses_each_answer_once_and_still_compares_with_each_gold(
    monkeypatch,
):
    from grpo.rewards import math as math_reward

    math_reward._parse_candidate.cache_clear()
    parsed: list[str] = []
    real_parse = math_reward.math_verify_parse

    def counting_parse(text, **kwargs):
        parsed.append(text)
        return real_parse(text, **kwargs)

    monkeypatch.setattr(math_reward, "math_verify_parse", counting_parse)
    reward = MathCorrectnessReward(partial_credit=0.25)
    scores = [reward("<answer>\\frac{1}{2}</answer>", gold).reward for gold in ("0.5", "3", "1/2")]
    assert scores == [1.0, 0.25, 1.0]  # the cached answer meets three different golds
    assert parsed.count("$\\frac{1}{2}$") == 1


def test_extract_answer_order_of_preference():
    assert extract_answer("<answer> 7 </answer> \\boxed{8} 9") == "7"
    assert extract_answer("<answer> </answer> \\boxed{8} 9") == "8"
    assert extract_answer("\\boxed{\\frac{1}{2}} then 9") == "\\frac{1}{2}"
    assert extract_answer("pages 3-5, total 1,234.", allow_last_number=True) == "1,234"
    assert extract_answer("pages 3-5", allow_last_number=True) == "5"
    assert extract_answer("it is -4", allow_last_number=True) == "-4"
    assert extract_answer("it is -4") is None  # strict by default
    assert extract_answer("no digits", allow_last_number=True) is None
    assert extract_answer("9 apples", allow_last_number=False) is None


# ---------------------------------------------------------------------------------------------
# Format and toy rewards
# ---------------------------------------------------------------------------------------------

FORMAT_CASES = [
    # (completion, options, reward, success)
    ("<think>5*17=85</think><answer>85</answer>", {}, 1.0, True),
    ("  <think>a\nb</think>\n<answer>85</answer>\n", {}, 1.0, True),
    ("<answer>85</answer>", {}, 0.5, False),
    ("<answer>85</answer>", {"think_required": False}, 1.0, True),
    ("<think>x</think><answer>85</answer>", {"think_required": False}, 1.0, True),
    ("Sure! <think>x</think><answer>85</answer>", {}, 0.5, False),
    ("Sure! <think>x</think><answer>85</answer>", {"strict": False}, 1.0, True),
    ("<think>x</think><answer>85", {}, 0.0, False),
    ("<think>x<answer>85</answer>", {}, 0.5, False),
    ("<think>x</think><answer></answer>", {}, 0.0, False),
    ("<think><think>x</think></think><answer>85</answer>", {}, 0.5, False),
    ("<think>x</think><answer><answer>85</answer></answer>", {}, 0.5, False),
    ("<think>x</think><answer>1</answer><answer>2</answer>", {}, 0.5, False),
    ("<answer>85</answer><think>x</think>", {}, 0.5, False),
    ("85", {"think_required": False}, 0.0, False),
]


@pytest.mark.parametrize("completion, options, reward, success", FORMAT_CASES)
def test_format_reward(completion, options, reward, success):
    reward_fn = FormatReward(answer_tag_reward=0.5, **options)
    assert reward_fn(completion, "85") == (reward, success)


def test_format_reward_survives_pickling():
    reward_fn = FormatReward(think_required=False, format_reward=2.0, name="fmt")
    copy = pickle.loads(pickle.dumps(reward_fn))
    assert copy.name == "fmt"
    assert copy("<answer>1</answer>", "1") == (2.0, True)


def test_token_presence_reward():
    reward_fn = TokenPresenceReward(token="<special>", reward=2.0, absent_reward=-1.0)
    assert reward_fn("a <special> b", "") == (2.0, True)
    assert reward_fn("a b", "") == (-1.0, False)
    with pytest.raises(ValueError, match="token"):
        TokenPresenceReward(token="")


def test_reward_function_decorator_configures_and_pickles():
    assert has_digit_reward("a1", "") == (1.0, True)
    assert has_digit_reward.name == "has_digit"
    assert has_digit_reward.failure_reward == -1.0
    configured = has_digit_reward(bonus=3.0, name="digit3")  # what a config's _component_ does
    assert configured("a1", "") == (3.0, True)
    assert configured.name == "digit3"
    copy = pickle.loads(pickle.dumps(configured))
    assert copy("b2", "") == (3.0, True)
    assert copy.name == "digit3"
    with pytest.raises(TypeError, match="unknown option"):
        has_digit_reward(bouns=2.0)


def test_function_reward_builds_from_a_config_node():
    from grpo.config import InstantiationError, instantiate

    path = f"{has_digit_reward.fn.__module__}.has_digit_reward"
    configured = instantiate({"_component_": path, "bonus": 3.0, "name": "digit3"})
    assert configured("a1", "") == (3.0, True)
    assert configured.name == "digit3" and configured.failure_reward == -1.0
    # A typo in the node is named, with the option the function does take.
    with pytest.raises(InstantiationError, match=r"'bouns' \(did you mean 'bonus'\?\)"):
        instantiate({"_component_": path, "bouns": 3.0})


# ---------------------------------------------------------------------------------------------
# batched_rewards
# ---------------------------------------------------------------------------------------------

COMPLETIONS = [
    "<think>5*17</think><answer>85</answer>",
    "<answer>86</answer>",
    "no answer at all",
]
ANSWERS = ["85", "85", "#### 85"]


def test_batched_rewards_shapes_and_order(pool):
    reward_fns = [FormatReward(answer_tag_reward=0.5), MathCorrectnessReward(partial_credit=0.1)]
    batch = batched_rewards(reward_fns, COMPLETIONS, ANSWERS, timeout_s=10.0, pool=pool)
    assert batch.func_names == ["format", "math_correctness"]
    assert batch.rewards.shape == (3, 2) and batch.rewards.dtype == torch.float32
    assert batch.successes.shape == (3, 2) and batch.successes.dtype == torch.float32
    expected = torch.tensor([[1.0, 1.0], [0.5, 0.1], [0.0, 0.0]])
    torch.testing.assert_close(batch.rewards, expected)
    torch.testing.assert_close(batch.successes, torch.tensor([[1.0, 1.0], [0, 0], [0, 0]]))
    assert batch.num_timeouts == {"format": 0, "math_correctness": 0}
    assert batch.num_exceptions == {"format": 0, "math_correctness": 0}
    torch.testing.assert_close(batch.total(), torch.tensor([2.0, 0.6, 0.0]))

    inline = batched_rewards(reward_fns, COMPLETIONS, ANSWERS, timeout_s=None)
    torch.testing.assert_close(inline.rewards, batch.rewards)
    torch.testing.assert_close(inline.successes, batch.successes)


def test_batched_rewards_hangs_and_errors_off_main_thread(pool):
    reward_fns = [SleepyReward(), SpinningReward(), RaisingReward(), MathCorrectnessReward()]
    completions = ["<answer>85</answer>"] * 6
    completions[1] = "HANG <answer>85</answer>"
    completions[3] = "SPIN BOOM <answer>85</answer>"
    answers = ["85"] * 6
    timeout_s = 1.0
    box: dict = {}

    def score() -> None:
        assert threading.current_thread() is not threading.main_thread()
        start = time.monotonic()
        box["batch"] = batched_rewards(
            reward_fns, completions, answers, timeout_s=timeout_s, pool=pool
        )
        box["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "batched_rewards did not return"
    batch = box["batch"]
    # Two hangs run on two workers at once; each costs about one timeout.
    assert box["elapsed"] < 2 * timeout_s + 4.0

    assert batch.num_timeouts == {"sleepy": 1, "spinning": 1, "raising": 0, "math_correctness": 0}
    assert batch.num_exceptions == {"sleepy": 0, "spinning": 0, "raising": 1, "math_correctness": 0}
    expected = torch.tensor([[0.25, 0.75, 0.5, 1.0]]).repeat(6, 1)
    expected[1, 0] = -1.0  # sleepy's failure_reward
    expected[3, 1] = -3.0  # spinning's failure_reward
    expected[3, 2] = -2.0  # raising's failure_reward
    torch.testing.assert_close(batch.rewards, expected)
    assert batch.successes[1, 0] == 0 and batch.successes[3, 1] == 0 and batch.successes[3, 2] == 0
    assert batch.successes[:, 3].tolist() == [1.0] * 6  # every other sample was scored

    # The pool recovered: the next call is clean, and is not held up by a timeout (the bound
    # allows for replacement workers starting on a loaded machine).
    start = time.monotonic()
    again = batched_rewards(
        reward_fns, ["<answer>85</answer>"] * 4, ["85"] * 4, timeout_s=timeout_s, pool=pool
    )
    assert time.monotonic() - start < 5.0
    assert sum(again.num_timeouts.values()) == 0 and sum(again.num_exceptions.values()) == 0
    torch.testing.assert_close(again.rewards, torch.tensor([[0.25, 0.75, 0.5, 1.0]]).repeat(4, 1))


def test_slow_rewards_shrink_the_chunks_and_are_not_timeouts():
    # 8 calls on 2 workers go as 2 chunks of 4: 1.2 s each, over the 1 s timeout. Run again one
    # per task, no call overruns, so each gets its real reward and later chunks are smaller.
    completions = ["a" * length for length in range(1, 9)]
    with RewardPool(num_workers=2) as pool:
        batch = batched_rewards([SlowReward()], completions, ["x"] * 8, timeout_s=1.0, pool=pool)
        assert batch.num_timeouts == {"slow": 0} and batch.num_exceptions == {"slow": 0}
        torch.testing.assert_close(batch.rewards[:, 0], torch.arange(1.0, 9.0))
        assert pool.max_calls_per_task == 2
        start = time.monotonic()
        again = batched_rewards([SlowReward()], completions, ["x"] * 8, timeout_s=1.0, pool=pool)
        # 4 chunks of 2 (0.6 s each) on 2 workers: no overrun, so no second pass.
        assert time.monotonic() - start < 2.5
        torch.testing.assert_close(again.rewards, batch.rewards)


def test_a_started_pool_scores_on_the_workers_it_started():
    # RewardPool.start starts the workers with the reward functions' modules imported: the
    # first batch starts no process (neither the forkserver nor a worker) and restarts none.
    import psutil

    reward_fns = [has_digit_reward, MathCorrectnessReward()]
    this_process = psutil.Process()
    with RewardPool(num_workers=2) as pool:
        pool.start(reward_fns)
        started = {child.pid for child in this_process.children(recursive=True)}
        batch = batched_rewards(reward_fns, ["\\boxed{7}", "\\boxed{2}"], ["7", "2"], pool=pool)
        assert {child.pid for child in this_process.children(recursive=True)} == started
    assert len(started) >= 2  # the two workers (and the forkserver, unless already running)
    torch.testing.assert_close(batch.rewards, torch.tensor([[1.0, 1.0], [1.0, 1.0]]))


def test_batched_rewards_worker_crash_is_counted(pool):
    completions = ["ok 1", "CRASH", "ok 3"]
    batch = batched_rewards(
        [CrashingReward(), has_digit_reward], completions, ["1"] * 3, timeout_s=5.0, pool=pool
    )
    assert batch.num_exceptions == {"crashing": 1, "has_digit": 0}
    torch.testing.assert_close(batch.rewards[:, 0], torch.tensor([1.0, -4.0, 1.0]))
    torch.testing.assert_close(batch.rewards[:, 1], torch.tensor([1.0, 0.0, 1.0]))


def test_batched_rewards_functions_that_cannot_load_in_a_worker(pool):
    batch = batched_rewards(
        [UnloadableReward()], ["a", "b", "c"], ["1"] * 3, timeout_s=5.0, pool=pool
    )
    assert batch.num_exceptions == {"unloadable": 3}
    torch.testing.assert_close(batch.rewards, torch.full((3, 1), -5.0))
    after = batched_rewards(
        [FormatReward()], ["<think>x</think><answer>1</answer>"], ["1"], pool=pool
    )
    assert after.rewards.tolist() == [[1.0]]


def test_user_defined_reward_in_batched_rewards(pool):
    reward_fns = [has_digit_reward, has_digit_reward(bonus=2.0, name="has_digit_x2")]
    batch = batched_rewards(reward_fns, ["abc", "a1c"], ["", ""], timeout_s=5.0, pool=pool)
    assert batch.func_names == ["has_digit", "has_digit_x2"]
    torch.testing.assert_close(batch.rewards, torch.tensor([[0.0, 0.0], [1.0, 2.0]]))
    torch.testing.assert_close(batch.successes, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_batched_rewards_inline_counts_exceptions_and_bad_results():
    @reward_function(name="bad_result")
    def returns_nan(completion: str, answer: str) -> tuple[float, bool]:
        return float("nan"), True

    batch = batched_rewards(
        [RaisingReward(), returns_nan], ["BOOM", "fine"], ["", ""], timeout_s=None
    )
    assert batch.num_exceptions == {"raising": 1, "bad_result": 2}
    torch.testing.assert_close(batch.rewards, torch.tensor([[-2.0, 0.0], [0.5, 0.0]]))


def test_batched_rewards_rejects_bad_input(pool):
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        batched_rewards([FormatReward()], ["a", "b"], ["1"])
    with pytest.raises(ValueError, match="duplicate"):
        batched_rewards([FormatReward(), FormatReward()], ["a"], ["1"])
    with pytest.raises(pickle.PicklingError, match="picklable"):
        batched_rewards([lambda completion, answer: (1.0, True)], ["a"], ["1"], pool=pool)
    empty = batched_rewards([FormatReward()], [], [], pool=pool)
    assert empty.rewards.shape == (0, 1)


def test_batched_rewards_64_samples_is_fast(pool):
    completions = [f"<think>adding</think><answer>{i}</answer>" for i in range(64)]
    answers = [str(i if i % 3 else i + 1) for i in range(64)]
    reward_fns = [MathCorrectnessReward(partial_credit=0.1), FormatReward()]
    batched_rewards(reward_fns, completions, answers, timeout_s=5.0, pool=pool)  # warm-up
    start = time.monotonic()
    batch = batched_rewards(reward_fns, completions, answers, timeout_s=5.0, pool=pool)
    elapsed = time.monotonic() - start
    assert batch.rewards.shape == (64, 2)
    assert batch.successes[:, 0].sum().item() == sum(1 for i in range(64) if i % 3)
    assert batch.successes[:, 1].sum().item() == 64
    # Typically ~0.05 s; the bound leaves room for a loaded shared machine while still
    # catching a per-call process start or a serialised round trip per sample.
    assert elapsed < 3.0, elapsed


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    eps = 1e-4
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=eps)
    scale = 0.5 / (math.sqrt(1 / 3) + eps)
    torch.testing.assert_close(advantages, torch.tensor([scale, -scale, -scale, scale]))
    # mean 2, unbiased std 1
    advantages = group_advantages(torch.tensor([3.0, 1.0, 2.0]), eps=eps)
    torch.testing.assert_close(advantages, torch.tensor([1 / (1 + eps), -1 / (1 + eps), 0.0]))
    advantages = group_advantages(torch.tensor([3.0, 1.0, 2.0]), std_normalize=False)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0]))


def test_group_advantages_degenerate_groups():
    equal = group_advantages(torch.full((5,), 0.1))
    assert torch.equal(equal, torch.zeros(5))
    single = group_advantages(torch.tensor([0.7]))
    assert torch.equal(single, torch.zeros(1))
    batch = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [3.0, 1.0, 2.0]]), eps=0.0)
    torch.testing.assert_close(batch, torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        group_advantages(torch.zeros(0))


def test_total_reward_weights():
    rewards = torch.tensor([[1.0, 0.5], [0.0, 1.0]])
    torch.testing.assert_close(total_reward(rewards), torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(total_reward(rewards, [1.0, 2.0]), torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="3 reward_weights for 2"):
        total_reward(rewards, [1.0, 2.0, 3.0])


def test_reward_weights_apply_by_name_whatever_the_column_order():
    # An environment's scores come in its own order: the weight follows the name.
    rewards = torch.tensor([[1.0, 0.5], [0.0, 1.0]])
    batch = RewardBatch(rewards, rewards > 0, ["format", "correct"], {}, {})
    torch.testing.assert_close(batch.total({"correct": 2.0}), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(batch.total({"format": 0.0, "correct": 1.0}), rewards[:, 1])
    torch.testing.assert_close(batch.total(None), torch.tensor([1.5, 1.0]))
    with pytest.raises(
        ValueError, match="no reward named 'exact'; the rewards are format, correct"
    ):
        batch.total({"exact": 1.0})


# ---------------------------------------------------------------------------------------------
# Reward functions as users write them: plain, TRL-style batched, with the example's columns
# ---------------------------------------------------------------------------------------------


def plain_float(completion: str, answer: str) -> float:
    return float(answer in completion)


def plain_bool(completion: str, answer: str) -> bool:
    return completion.startswith("<answer>")


def trl_short(completions: list[str], **kwargs) -> list[float]:
    return [float(len(completion) < 10) for completion in completions]


def trl_by_level(prompts: list[str], completions: list[str], level: list[int]) -> list:
    # None: the function does not apply (TRL's meaning).
    return [None if lvl == 0 else lvl / 10 + float(p == "P0") for p, lvl in zip(prompts, level)]


def per_sample_with_columns(completion: str, answer: str, level: int, scale: float = 1.0):
    return level * scale, level > 1


def every_column(completion: str, answer: str, **columns) -> float:
    return float(sorted(columns) == ["level", "prompt", "question"])


def misspelt(completion: str, answer: str) -> float:
    return float(len(completon) < 50)  # noqa: F821 (the typo under test)


MISSPELT_LINE = misspelt.__code__.co_firstlineno + 1


def test_plain_and_trl_style_functions_score_as_written(pool):
    completions = ["<answer>3</answer>", "three, not 3", "no"]
    answers = ["3", "4", "5"]
    columns = [
        {"level": 2, "prompt": "P0", "question": "q0"},
        {"level": 0, "prompt": "P1", "question": "q1"},
        {"level": 1, "prompt": "P2", "question": "q2"},
    ]
    functions = [
        reward_function(plain_float),
        reward_function(plain_bool),
        reward_function(trl_short),
        reward_function(trl_by_level),
        reward_function(per_sample_with_columns)(scale=2.0),  # an option, the rest columns
        reward_function(every_column),
    ]
    batch = batched_rewards(
        functions, completions, answers, timeout_s=5.0, pool=pool, columns=columns
    )
    assert sum(batch.num_exceptions.values()) == 0, batch.failure_reasons
    expected = [
        # plain float, bool, TRL short, TRL by level (None -> 0), columns, every column
        [1.0, 1.0, 0.0, 1.2, 4.0, 1.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        [0.0, 0.0, 1.0, 0.1, 2.0, 1.0],
    ]
    torch.testing.assert_close(batch.rewards, torch.tensor(expected))
    # A float succeeds above 0; "not applicable" is no success and no failure.
    assert batch.successes[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert batch.successes[:, 3].tolist() == [1.0, 0.0, 1.0]
    assert batch.successes[:, 4].tolist() == [1.0, 0.0, 0.0]
    inline = batched_rewards(functions, completions, answers, timeout_s=None, columns=columns)
    torch.testing.assert_close(inline.rewards, batch.rewards)


def test_a_failing_call_is_named_by_its_exception_and_line(pool):
    batch = batched_rewards(
        [reward_function(misspelt), reward_function(plain_float)],
        ["a", "b", "c"],
        ["a", "x", "c"],
        timeout_s=5.0,
        pool=pool,
    )
    assert batch.num_exceptions == {"misspelt": 3, "plain_float": 0}
    reason = batch.failure_reasons["misspelt"]
    assert reason.startswith("NameError: name 'completon' is not defined (at ")
    assert f"{__file__}:{MISSPELT_LINE} in misspelt" in reason
    assert "grpo/rewards" not in reason  # the pool's frames are not where it raised
    calls = batch.calls()
    assert (calls["misspelt"].calls, calls["misspelt"].exceptions) == (3, 3)
    assert calls["plain_float"].failed == 0 and calls["plain_float"].reason is None


def test_returns_that_are_no_reward_are_failures_that_say_what_to_return():
    @reward_function(name="none")
    def returns_none(completion: str, answer: str) -> None:
        return None

    @reward_function(name="batched_two")
    def returns_two(completions, **kwargs) -> list[float]:
        return [1.0, 2.0]

    batch = batched_rewards([returns_none, returns_two], ["a"], ["a"], timeout_s=None)
    assert batch.num_exceptions == {"none": 1, "batched_two": 1}
    assert "returned NoneType None; return a float, a bool" in batch.failure_reasons["none"]
    assert "expected a list of one float per completion" in batch.failure_reasons["batched_two"]


def test_the_environment_passes_the_example_columns_and_counts_the_calls():
    from grpo.envs import Episode, SingleTurnEnv

    env = SingleTurnEnv([reward_function(per_sample_with_columns), reward_function(misspelt)])
    episodes = []
    for level in (1, 3):
        example = {"question": "q", "answer": "7", "prompt": "P", "index": 0, "level": level}
        episode = Episode(example=example, prompt_ids=[1], messages=[])
        episode.messages = [{"role": "assistant", "content": "7"}]
        episodes.append(episode)
    env.reward_timeout_s = 5.0
    rewards = env._score_now(episodes)
    assert [r["per_sample_with_columns"] for r in rewards] == [1.0, 3.0]
    env._score_now(episodes[:1])
    calls = env.take_reward_calls()
    assert calls["per_sample_with_columns"] == {
        "calls": 3,
        "timeouts": 0,
        "exceptions": 0,
        "reason": None,
    }
    assert calls["misspelt"]["exceptions"] == 3 and "NameError" in calls["misspelt"]["reason"]
    assert env.take_reward_calls() == {}  # taken once


# Reward function nodes that `grpo validate` and the run must both accept, or both refuse
# naming the same key. The module is written to a folder on sys.path, as a user's would be.
USER_REWARDS = """
from grpo.rewards import RewardFunction, RewardResult, reward_function


def plain_float(completion: str, answer: str) -> float:
    return float(answer in completion)


def short_reward(completions, **kwargs):
    return [float(len(c) < 50) for c in completions]


def with_column(completion, answer, level, scale=1.0):
    return level * scale


@reward_function(name="digits", failure_reward=-1.0)
def digits(completion, answer, bonus=1.0):
    return bonus * any(c.isdigit() for c in completion), True


class Short(RewardFunction):
    name = "short_class"

    def __init__(self, *, max_chars=10, **kwargs):
        super().__init__(**kwargs)
        self.max_chars = max_chars

    def __call__(self, completion, answer):
        return float(len(completion) <= self.max_chars), True


def make_short(max_chars):
    return Short(max_chars=max_chars)


def text_and_gold(text, gold):
    return 1.0


def completion_only(completion):
    return 1.0
"""

ACCEPTED_NODES = [
    "{_component_: M.plain_float}",
    "{_component_: M.plain_float, name: exact, failure_reward: -1.0}",
    "{_component_: M.short_reward}",
    "{_component_: M.with_column, scale: 2.0}",
    "{_component_: M.digits, bonus: 2.0}",
    "{_component_: M.Short, max_chars: 5}",
    "{_component_: M.make_short, max_chars: 5}",  # a factory given what it needs
]
REFUSED_NODES = [
    # (node, the problem's key, words of it)
    ("{_component_: M.text_and_gold}", "reward_functions[0]", "is not a reward function"),
    ("{_component_: M.make_short}", "reward_functions[0]", "is not a reward function"),
    ("{_component_: M.completion_only}", "reward_functions[0]", "takes no answer"),
    ("{_component_: M.with_column, scael: 2.0}", "reward_functions[0]", "scael"),
    ("{_component_: M.plain_float, max_chars: 2}", "reward_functions[0]", "max_chars"),
    ("{_component_: M.digits, bouns: 2.0}", "reward_functions[0]", "bouns"),
]


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _validate_and_build(module: str, node: str) -> tuple[list[str], list[str], str | None]:
    """The reward problems of `grpo validate` (source) and of the run's check (import), and
    what building the environment raised (None: built)."""
    from grpo.config import ConfigError, check_config, compose_config
    from grpo.envs import build_environment

    node = node.replace("M.", f"{module}.")
    cfg = compose_config("tiny_arithmetic_cpu", [f"reward_functions=[{node}]"])
    found = []
    for import_components in (False, True):
        checked = check_config(cfg, import_components=import_components)
        found.append([p for p in checked.problems if p.startswith("reward_functions")])
    try:
        env = build_environment(None, checked.values["reward_functions"], 5.0)
    except ConfigError as error:
        return found[0], found[1], str(error)
    assert callable(env.reward_functions[0])
    return found[0], found[1], None


@pytest.mark.parametrize("node", ACCEPTED_NODES)
def test_validate_and_the_run_accept_the_same_reward_functions(node, user_rewards):
    assert _validate_and_build(user_rewards, node) == ([], [], None)


@pytest.mark.parametrize("node, key, words", REFUSED_NODES)
def test_validate_and_the_run_refuse_the_same_reward_functions(node, key, words, user_rewards):
    source, imported, built = _validate_and_build(user_rewards, node)
    assert len(source) == 1 and source == imported, (source, imported)
    assert source[0].startswith(key) and words in source[0]
    assert built is not None and built.startswith(f"{key}") and words in built
    if words in ("is not a reward function", "takes no answer"):
        # One line that says what to write, the same from validate and from the run.
        assert built == source[0] and "\n" not in built
        assert "fn(completion, answer, **columns)" in built and "fn(completions" in built


def test_a_plain_function_in_an_environment_node_is_built_as_a_reward(user_rewards):
    from grpo.config import ConfigError
    from grpo.envs import build_environment

    node = {
        "_component_": "grpo.testing.tools.EchoUserEnv",
        "reward_functions": [{"_component_": f"{user_rewards}.plain_float"}],
    }
    env = build_environment(node, [], 5.0)
    assert env.reward_functions[0]("x 3", "3") == 1.0
    node["reward_functions"] = [{"_component_": f"{user_rewards}.text_and_gold"}]
    with pytest.raises(ConfigError, match=r"^environment\.reward_functions\[0\]: .* is not a"):
        build_environment(node, [], 5.0)


def test_reward_signatures_are_read_once_per_function(monkeypatch):
    """`select_columns` runs per completion; the signature behind it is read once."""
    import dataclasses
    import inspect

    from grpo.rewards import base

    @dataclasses.dataclass  # eq=True: instances are unhashable
    class Unhashable:
        def __call__(self, completion, answer, difficulty=None):
            return 1.0

    class WithColumn(base.RewardFunction):
        def __call__(self, completion, answer, difficulty=None):
            return base.RewardResult(1.0, True)

    reads = []
    signature = inspect.signature
    monkeypatch.setattr(base.inspect, "signature", lambda fn: reads.append(fn) or signature(fn))
    row = {"difficulty": 3, "source": "x"}
    first, second = WithColumn(), WithColumn()
    for reward in (first, second, first):
        assert reward.select_columns(row) == {"difficulty": 3}
    # Bound to two instances, one function: read once, without ``self``.
    assert len(reads) == 1
    assert [p.name for p in base.call_parameters(second.__call__)] == [
        "completion",
        "answer",
        "difficulty",
    ]
    # An unhashable callable object is read every time, and still right.
    callable_object = Unhashable()
    for _ in range(2):
        assert [p.name for p in base.call_parameters(callable_object)][-1] == "difficulty"
    assert len(reads) == 3
