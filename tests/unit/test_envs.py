"""Multi-turn and tool-using episodes: token-exact sequences, limits, and tools that misbehave.

The engine is scripted here (a unit test of the rollout logic around it): each policy turn
returns the canonical tokens of a scripted text, so the expected sequence is known exactly.
Tools run for real in worker processes; the tokenizer and chat template are the tiny Qwen2's
(ChatML). The real engine runs the same path in tests/integration/test_collector.py.
"""

import json
import time
from typing import Annotated

import pytest
import torch
from pydantic import Field

from grpo.config.options import checked_options, option_problems
from grpo.data import prompt_dataset
from grpo.data.stream import PromptStream
from grpo.envs import (
    ChatTurnRenderer,
    MultiTurnEnv,
    PlainTurnRenderer,
    Sample,
    Tool,
    ToolEnv,
    ToolRunner,
    VerifiersEnv,
    episode_groups,
    parse_tool_calls,
    run_episodes,
)
from grpo.envs.builtin_tools import calculator, python
from grpo.envs.dropped import scored_episodes
from grpo.envs.tools import CALL_FORMATS
from grpo.models import load_tokenizer
from grpo.rewards import MathCorrectnessReward
from grpo.testing.tools import EchoUserEnv

FORMATS = ", ".join(CALL_FORMATS)


def _call(expression: str) -> str:
    return (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "'
        + expression
        + '"}}</tool_call>'
    )


class ScriptedEngine:
    """Samples scripted assistant texts: turn t of every episode is ``script[t]``.

    ``script`` may instead map prompt token ids (a tuple) to that prompt's turns. Each call's
    time is kept in ``times``.
    """

    def __init__(self, tokenizer, script, close_with_stop_token: bool = True):
        self.tokenizer = tokenizer
        self.script = script
        self.close = close_with_stop_token
        self.requests = []
        self.times = []

    def _turns(self, request):
        if isinstance(self.script, list):
            return self.script
        for prompt, turns in self.script.items():
            if tuple(request.token_ids[: len(prompt)]) == prompt:
                return turns
        raise KeyError("no script for this prompt")

    def __call__(self, requests):
        self.requests.append(list(requests))
        self.times.append(time.perf_counter())
        samples = []
        for request in requests:
            turn = self._turn_of(request)
            ids = self.tokenizer.encode(self._turns(request)[turn], add_bos=False, add_eos=False)
            if self.close:
                ids.append(self.tokenizer.eos_id)
            finish = "stop"
            if len(ids) > request.max_tokens:
                ids, finish = ids[: request.max_tokens], "length"
            samples.append(Sample(ids, [-0.5] * len(ids), finish))
        return samples

    def _turn_of(self, request):
        # How many rounds this sequence has been through: count earlier requests it extends.
        return sum(
            any(request.token_ids[: len(r.token_ids)] == r.token_ids for r in round_requests)
            for round_requests in self.requests[:-1]
        )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def runner():
    with_runner = ToolRunner(num_workers=2)
    yield with_runner
    with_runner.close()


def _prompt(tokenizer, question: str, index: int = 0):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    example = {"question": question, "answer": "7", "prompt": text, "index": index}
    return example, tokenizer.encode(text, add_bos=False, add_eos=False)


def _run(env, engine, tokenizer, prompts, group_size=1, max_model_len=2048, per_turn=256):
    return run_episodes(
        env,
        engine,
        tokenizer,
        ChatTurnRenderer(tokenizer),
        prompts,
        group_size=group_size,
        max_tokens_per_turn=per_turn,
        max_model_len=max_model_len,
        seeds=[0] * len(prompts),
    )


def test_three_turn_episode_is_the_sampled_tokens_plus_rendered_tool_turns(tokenizer, runner):
    script = [_call("2*3"), _call("6+1"), "<answer>7</answer>"]
    env = ToolEnv(
        tools=[calculator],
        reward_functions=[MathCorrectnessReward()],
        max_turns=5,
        runner=runner,
    )
    engine = ScriptedEngine(tokenizer, script)
    example, prompt_ids = _prompt(tokenizer, "What is 2*3+1?")
    [[episode]] = _run(env, engine, tokenizer, [(example, prompt_ids)])

    assert episode.error is None and not episode.truncated and not episode.hit_max_turns
    assert episode.num_turns == 3 and episode.tool_calls == 2 and not episode.tool_errors
    assert [m["role"] for m in episode.messages] == [
        "user", "assistant", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["6", "7"]

    # The policy's tokens, in order, are exactly what the engine sampled.
    response = torch.tensor(episode.response_ids)
    mask = torch.tensor(episode.response_mask)
    sampled = [t for turn in script for t in tokenizer.encode(turn, add_bos=False, add_eos=False)]
    policy_ids = response[mask].tolist()
    assert policy_ids == [
        t
        for turn in script
        for t in [*tokenizer.encode(turn, add_bos=False, add_eos=False), tokenizer.eos_id]
    ]
    assert len(policy_ids) == len(sampled) + 3
    # Each turn's request extended the previous tokens: nothing was re-tokenised.
    rounds = [r[0].token_ids for r in engine.requests]
    for earlier, later in zip(rounds, rounds[1:]):
        assert later[: len(earlier)] == earlier
    # ChatML renders every turn the same wherever it sits, so the whole sequence is the chat
    # template's rendering of the whole conversation (up to the final end-of-turn token).
    whole = tokenizer.encode(
        tokenizer.apply_chat_template(episode.messages, add_generation_prompt=False),
        add_bos=False,
        add_eos=False,
    )
    sequence = prompt_ids + episode.response_ids
    assert whole[: len(sequence)] == sequence
    assert tokenizer.decode(whole[len(sequence) :]) == "\n"
    # Environment tokens carry no logprob and are not trained.
    assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.response_mask) if not m)
    assert episode.env_tokens == int((~mask).sum())

    [group] = episode_groups(
        [[episode]],
        env.score([episode]),
        group_ids=[3],
        sequence_id=iter(["s0"]).__next__,
        policy_version=2,
    )
    [trajectory] = group.trajectories
    assert trajectory.env_rewards == {"math_correctness": 1.0}
    assert trajectory.policy_len == len(policy_ids)
    assert trajectory.episode_stats["turns"] == 3.0
    assert trajectory.episode_stats["tool_calls"] == 2.0


def test_a_turn_that_stops_on_a_stop_string_is_closed_by_the_environment(tokenizer, runner):
    """Stopped on ``</tool_call>`` (no end-of-turn token): the env turn starts with it."""
    env = ToolEnv(tools=[calculator], reward_functions=[MathCorrectnessReward()], runner=runner)
    engine = ScriptedEngine(tokenizer, [_call("3+4"), "<answer>7</answer>"], False)
    example, prompt_ids = _prompt(tokenizer, "What is 3+4?")
    [[episode]] = _run(env, engine, tokenizer, [(example, prompt_ids)])
    first_env = episode.response_ids[episode.turn_lengths[0] :][:3]
    assert tokenizer.decode(first_env).startswith("<|im_end|>\n<|im_start|>")


def test_misbehaving_tools_answer_with_errors_and_are_counted(tokenizer):
    """A hanging, a crashing and a raising tool, an undeclared tool, bad arguments and a call
    that does not parse: each is one error turn; the episodes go on to their answer."""
    runner = ToolRunner(num_workers=2)
    try:
        env = ToolEnv(
            tools=[
                calculator,
                "grpo.testing.tools.hang",
                "grpo.testing.tools.crash",
                "grpo.testing.tools.fail",
            ],
            tool_timeout_s=1.0,
            reward_functions=[MathCorrectnessReward()],
            max_turns=3,
            runner=runner,
        )
        first_turn = (
            '<tool_call>{"name": "hang", "arguments": {"seconds": 30}}</tool_call>'
            '<tool_call>{"name": "crash", "arguments": {"code": 3}}</tool_call>'
            '<tool_call>{"name": "fail", "arguments": {"message": "boom"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        )
        second_turn = (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>'
            "<tool_call>{not json</tool_call>"
        )
        engine = ScriptedEngine(tokenizer, [first_turn, second_turn, "<answer>7</answer>"])
        example, prompt_ids = _prompt(tokenizer, "What is 3+4?")
        start = time.perf_counter()
        [[episode]] = _run(env, engine, tokenizer, [(example, prompt_ids)], per_turn=600)
        elapsed = time.perf_counter() - start
    finally:
        runner.close()
    assert elapsed < 15, "a hanging tool held the episode past its timeout"
    assert episode.error is None and episode.num_turns == 3
    assert episode.tool_calls == 6
    assert episode.tool_errors == {
        "timeout": 1,
        "crash": 1,
        "exception": 1,
        "unknown_tool": 1,
        "bad_arguments": 1,
        "parse_error": 1,
    }
    tool_turns = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert len(tool_turns) == 6 and all(turn.startswith("error: ") for turn in tool_turns)
    assert "boom" in tool_turns[2]
    assert "no tool named 'search'" in tool_turns[3]
    assert "must be a string, got 7" in tool_turns[4]
    assert episode.stats()["tool_errors"] == 6.0


def test_an_episode_waiting_on_a_tool_holds_no_other(tokenizer):
    """One episode's tool sleeps 4 s; the other's episode runs to its end meanwhile."""
    runner = ToolRunner(num_workers=2)
    try:
        env = ToolEnv(
            tools=[calculator, "grpo.testing.tools.hang"],
            tool_timeout_s=10.0,
            reward_functions=[MathCorrectnessReward()],
            max_turns=3,
            runner=runner,
        )
        slow_example, slow_prompt = _prompt(tokenizer, "Wait for it.", index=0)
        fast_example, fast_prompt = _prompt(tokenizer, "What is 3+4?", index=1)
        slow_call = '<tool_call>{"name": "hang", "arguments": {"seconds": 4}}</tool_call>'
        engine = ScriptedEngine(
            tokenizer,
            {
                tuple(slow_prompt): [slow_call, "<answer>done</answer>"],
                tuple(fast_prompt): [_call("3+4"), "<answer>7</answer>"],
            },
        )
        start = time.perf_counter()
        [[slow], [fast]] = _run(
            env, engine, tokenizer, [(slow_example, slow_prompt), (fast_example, fast_prompt)]
        )
    finally:
        runner.close()
    # The first round held both; the fast episode's answer turn came in a round of its own,
    # long before the sleeping tool returned; the slow one's answer turn after it.
    assert [len(round_requests) for round_requests in engine.requests] == [2, 1, 1]
    assert engine.times[1] - start < 2.5
    assert engine.times[2] - start >= 4.0
    assert fast.last_assistant_text() == "<answer>7</answer>" and fast.num_turns == 2
    assert [m["content"] for m in slow.messages if m["role"] == "tool"] == ["woke up"]
    assert slow.num_turns == 2 and not slow.tool_errors


class SteppedEngine:
    """A continuous engine (`grpo.envs.rollout.TurnEngine`) that samples a scripted turn one
    token per step of ``step_s`` seconds, like vLLM's; ``log`` records each turn's submit and
    finish step."""

    def __init__(self, tokenizer, script, step_s=0.02):
        self.step_s = step_s
        self.script = ScriptedEngine(tokenizer, script)
        self.running = {}
        self.steps = 0
        self.log = []

    def submit(self, request):
        [sample] = self.script([request])
        key = len(self.log)
        self.running[key] = [sample, len(sample.token_ids)]
        self.log.append({"submitted": self.steps, "request": request})
        return key

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        finished = []
        for key, entry in list(self.running.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                finished.append((key, entry[0]))
                self.log[key]["finished"] = self.steps
                del self.running[key]
        return finished


def test_a_ready_episode_joins_the_running_batch(tokenizer, runner):
    """With a continuous engine, an episode whose tool answered starts its next turn while a
    long turn of another episode is still being sampled."""
    env = ToolEnv(tools=[calculator], reward_functions=[MathCorrectnessReward()], runner=runner)
    long_example, long_prompt = _prompt(tokenizer, "Tell me a story.", index=0)
    short_example, short_prompt = _prompt(tokenizer, "What is 3+4?", index=1)
    story = "<answer>" + "once upon a time " * 12 + "</answer>"
    engine = SteppedEngine(
        tokenizer,
        {
            tuple(long_prompt): [story],
            tuple(short_prompt): [_call("3+4"), "<answer>7</answer>"],
        },
    )
    [[long], [short]] = _run(
        env, engine, tokenizer, [(long_example, long_prompt), (short_example, short_prompt)]
    )
    story_turn, call_turn, answer_turn = engine.log
    assert story_turn["request"].token_ids == long_prompt
    assert answer_turn["submitted"] > call_turn["finished"]
    assert answer_turn["finished"] < story_turn["finished"]  # joined while the story ran
    assert short.last_assistant_text() == "<answer>7</answer>" and short.tool_calls == 1
    assert long.num_turns == 1 and long.last_assistant_text() == story


def test_a_tool_past_its_memory_cap_gets_an_error_and_the_worker_lives_on():
    from grpo.envs.tools import EXCEPTION
    from grpo.testing.tools import allocate

    runner = ToolRunner(num_workers=1, memory_mb=256)
    try:
        tool = Tool(allocate)
        big, small = runner.run([(tool, {"megabytes": 1024}), (tool, {"megabytes": 16})], 10.0)
    finally:
        runner.close()
    assert big.error == EXCEPTION and big.text.startswith("MemoryError")
    assert small == ("held 16 MB", None)  # the same worker, still serving


def test_max_turns_and_token_budget_end_episodes(tokenizer):
    engine = ScriptedEngine(tokenizer, ["one two three"] * 10)
    prompts = [_prompt(tokenizer, "Hi", index=1)]
    env = EchoUserEnv(max_turns=3, reward_functions=[MathCorrectnessReward()])
    [[episode]] = _run(env, engine, tokenizer, prompts)
    assert episode.num_turns == 3 and episode.hit_max_turns and not episode.truncated
    assert [m["content"] for m in episode.messages if m["role"] == "user"][1:] == ["again"] * 2

    budget_env = EchoUserEnv(max_turns=10, max_episode_tokens=30, reward_functions=[])
    engine = ScriptedEngine(tokenizer, ["one two three"] * 10)
    [[episode]] = _run(budget_env, engine, tokenizer, prompts)
    assert episode.truncated and not episode.hit_max_turns
    assert len(episode.response_ids) <= 30
    assert 1 < episode.num_turns < 10


def test_an_environment_that_raises_drops_only_its_episode(tokenizer):
    env = EchoUserEnv(
        max_turns=3,
        raise_on_turn=2,
        reward_functions=[MathCorrectnessReward()],
        failed_episodes="drop",
    )
    engine = ScriptedEngine(tokenizer, ["<answer>7</answer>"] * 3)
    prompts = [_prompt(tokenizer, "Hi", index=0), _prompt(tokenizer, "Hi", index=1)]
    groups = _run(env, engine, tokenizer, prompts, group_size=2)
    failed = [e for group in groups for e in group if e.error is not None]
    assert len(failed) == 2 and all(e.example["index"] == 0 for e in failed)
    # The reason names the exception and the line of the environment's code that raised it.
    assert failed[0].error.startswith("RuntimeError: scripted failure at turn 2 (at ")
    assert "grpo/testing/tools.py:" in failed[0].error and "in env_response" in failed[0].error
    kept, rewards = scored_episodes(env, [e for group in groups for e in group])
    assert kept == [e for group in groups for e in group if e.error is None]
    trajectories = episode_groups(
        groups,
        rewards,
        group_ids=[0, 1],
        sequence_id=iter(f"s{i}" for i in range(9)).__next__,
        policy_version=0,
    )
    assert [g.group_id for g in trajectories] == [1]
    assert len(trajectories[0].trajectories) == 2


class OwnScoreEchoEnv(EchoUserEnv):
    """Scores episodes itself, under names no reward function declares."""

    def score(self, episodes):
        return [
            {"turns": float(e.num_turns), "tokens": float(len(e.response_ids))} for e in episodes
        ]


def test_a_failed_episode_stays_in_its_group_scored_with_the_failure_reward(tokenizer):
    """By default a multi-turn environment keeps an episode whose environment raised in its
    group: its tokens are what the policy sampled up to the failure (only those are trained),
    and each reward is its function's failure reward; an environment with its own score gives
    0 under its names."""
    reward = MathCorrectnessReward(failure_reward=-1.0)
    env = EchoUserEnv(max_turns=3, raise_on_turn=2, reward_functions=[reward])
    assert env.failed_episodes == "score" and ToolEnv(tools=[calculator]).failed_episodes == "score"
    assert VerifiersEnv.failed_episodes == "drop"  # its failed episodes hold no tokens
    with pytest.raises(ValueError, match="failed_episodes"):
        EchoUserEnv(failed_episodes="keep")
    engine = ScriptedEngine(tokenizer, ["<answer>7</answer>"] * 3)
    prompts = [_prompt(tokenizer, "Hi", index=0), _prompt(tokenizer, "Hi", index=1)]
    groups = _run(env, engine, tokenizer, prompts, group_size=2)
    every = [e for group in groups for e in group]
    kept, rewards = scored_episodes(env, every)
    assert kept == every
    assert [e.failure_scored for e in every] == [True, True, False, False]
    assert all(e.error.startswith("RuntimeError: scripted failure at turn 2") for e in every[:2])
    assert [r["math_correctness"] for r in rewards] == [-1.0, -1.0, 1.0, 1.0]

    trajectories = episode_groups(
        groups,
        rewards,
        group_ids=[0, 1],
        sequence_id=iter(f"s{i}" for i in range(9)).__next__,
        policy_version=0,
    )
    assert [len(g.trajectories) for g in trajectories] == [2, 2]  # every member counts
    failed = trajectories[0].trajectories[0]
    assert failed.env_rewards == {"math_correctness": -1.0}
    assert failed.env_successes == {"math_correctness": 0.0}
    # Turn 1, the user's "again", turn 2 (the environment raised on it): only the policy's
    # tokens are marked, and the sequence ends with the turn that made it raise.
    turn = tokenizer.encode("<answer>7</answer>", add_bos=False, add_eos=False)
    turn.append(tokenizer.eos_id)
    tokens, mask = failed.response_tokens.tolist(), failed.response_mask.tolist()
    assert tokens[: len(turn)] == turn and tokens[-len(turn) :] == turn
    assert mask == [True] * len(turn) + [False] * (len(tokens) - 2 * len(turn)) + [True] * len(turn)
    assert failed.logprobs.tolist()[-len(turn) :] == [-0.5] * len(turn)

    own = OwnScoreEchoEnv(max_turns=3, raise_on_turn=2)
    groups = _run(own, ScriptedEngine(tokenizer, ["<answer>7</answer>"] * 3), tokenizer, prompts, 2)
    kept, rewards = scored_episodes(own, [e for group in groups for e in group])
    assert len(kept) == 4 and rewards[0] == {"turns": 0.0, "tokens": 0.0}
    assert rewards[2]["turns"] == 3.0


def test_tools_check_their_arguments_and_calls_parse_in_both_formats():
    tool = Tool(calculator)
    assert tool.check_arguments({"expression": "1+1"}) is None
    assert "missing the argument 'expression'" in tool.check_arguments({})
    assert tool.schema()["function"]["parameters"]["required"] == ["expression"]
    tools = {"calculator": tool}
    [call] = parse_tool_calls("I will compute <calculator>12*34</calculator>", "tag", tools)
    assert (call.name, call.arguments) == ("calculator", {"expression": "12*34"})
    [call] = parse_tool_calls(_call("1+2"), "json", tools)
    assert call.arguments == {"expression": "1+2"}
    assert parse_tool_calls("<answer>3</answer>", "json", tools) == []
    with pytest.raises(ValueError, match="module-level function"):
        Tool(lambda expression: expression)
    with pytest.raises(ValueError, match="needs a type hint"):
        Tool(len)


def test_python_tool_has_no_network_and_writes_only_in_its_folder(runner):
    tool = Tool(python)
    outcomes = runner.run(
        [
            (tool, {"code": "print(sum(range(10)))"}),
            (tool, {"code": "import socket\nsocket.create_connection(('127.0.0.1', 9))"}),
            (tool, {"code": "open('/tmp/grpo-python-tool-escape', 'w')"}),
            (tool, {"code": "open('notes.txt', 'w').write('ok'); print(open('notes.txt').read())"}),
            (tool, {"code": "import subprocess\nsubprocess.run(['ls'])"}),
        ],
        timeout_s=20,
    )
    assert outcomes[0].text == "45\n" and outcomes[0].error is None
    assert "network access is disabled" in outcomes[1].text and outcomes[1].error == "exception"
    assert "writing outside the working folder" in outcomes[2].text
    assert outcomes[3].text == "ok\n"
    assert "disabled" in outcomes[4].text


def test_plain_renderer_formats_environment_turns(tokenizer):
    renderer = PlainTurnRenderer(tokenizer)
    ids = renderer.env_tokens([{"role": "tool", "content": "42"}], closed=True)
    assert tokenizer.decode(ids) == "<result>42</result>"
    with pytest.raises(ValueError, match="no plain format for 'system'"):
        renderer.env_tokens([{"role": "system", "content": "x"}], closed=True)


def test_base_environment_needs_env_response():
    env = MultiTurnEnv(reward_functions=[MathCorrectnessReward()])
    with pytest.raises(NotImplementedError):
        env.env_response([], {}, None)
    with pytest.raises(ValueError, match="MultiTurnEnv: max_turns: expected an int >= 1, got 0"):
        MultiTurnEnv(max_turns=0)


def test_validate_names_each_environment_mistake(tmp_path, capsys):
    from grpo.cli import main

    def problems(environment: str) -> str:
        status = main(
            ["validate", "tiny_arithmetic_cpu", f"output_dir={tmp_path}/run", environment]
        )
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err
        return err

    assert (
        "environment.tools[0]: cannot import 'grpo.envs.calculatorr': module grpo.envs has no "
        "'calculatorr'; did you mean 'calculator'?"
    ) in problems("environment={_component_: grpo.envs.ToolEnv, tools: [grpo.envs.calculatorr]}")
    assert "environment.tools[0]: tool getcwd takes no parameter" in problems(
        "environment={_component_: grpo.envs.ToolEnv, tools: [os.getcwd]}"
    )
    assert f"environment.call_format: expected one of {FORMATS}, got 'xml'" in problems(
        "environment={_component_: grpo.envs.ToolEnv, tools: [grpo.envs.calculator], "
        "call_format: xml}"
    )
    assert "environment.max_turn: grpo.envs.ToolEnv takes no argument 'max_turn'" in problems(
        "environment={_component_: grpo.envs.ToolEnv, tools: [grpo.envs.calculator], max_turn: 3}"
    )
    assert (
        main(
            [
                "validate",
                "tiny_arithmetic_cpu",
                f"output_dir={tmp_path}/run",
                "environment={_component_: grpo.envs.ToolEnv, tools: [grpo.envs.calculator, "
                "grpo.envs.python], max_turns: 3}",
            ]
        )
        == 0
    )


def test_a_tool_with_two_required_parameters_is_refused_under_the_tag_format(
    tmp_path, capsys, monkeypatch
):
    """`tag` passes one text: validate and the environment refuse what it cannot call."""
    from grpo.cli import main

    (tmp_path / "two_parameter_tools.py").write_text(
        "def convert(amount: float, rate: float) -> str:\n"
        '    """Convert an amount of money at an exchange rate."""\n'
        '    return f"{amount * rate:.2f}"\n\n\n'
        "def scale(amount: float, rate: float = 2.0) -> str:\n"
        '    """Scale an amount."""\n'
        '    return f"{amount * rate:.2f}"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = "environment.tools=[grpo.envs.calculator,two_parameter_tools.convert]"
    status = main(["validate", "tiny_calculator_cpu", f"output_dir={tmp_path}/run", tools])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    expected = (
        "environment.call_format: tag passes the text inside <convert>...</convert> as the "
        "tool's first parameter ('amount') only, but convert also requires 'rate'; use "
        "call_format: json"
    )
    assert err.startswith(f"grpo validate: error: {expected}"), err
    assert len(err.splitlines()) == 1, err

    import two_parameter_tools

    with pytest.raises(ValueError, match="but convert also requires 'rate'"):
        ToolEnv(tools=[two_parameter_tools.convert], call_format="tag")
    # A second parameter with a default, or the json format, can be called.
    ToolEnv(tools=[two_parameter_tools.scale], call_format="tag")
    ToolEnv(tools=[two_parameter_tools.convert], call_format="json")
    for overrides in (
        [tools, "environment.call_format=json"],
        ["environment.tools=[two_parameter_tools.scale]"],
    ):
        status = main(["validate", "tiny_calculator_cpu", f"output_dir={tmp_path}/r", *overrides])
        assert status == 0, capsys.readouterr().err


def test_run_refuses_an_environment_that_cannot_be_built(tmp_path, capsys, monkeypatch):
    """An option out of bounds is the line ``grpo validate`` gives, from ``grpo run`` before
    Ray."""
    from grpo.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    status = main(
        [
            "run",
            "async_grpo",
            "--config",
            "tiny_calculator_cpu",
            f"output_dir={tmp_path}/run",
            "environment.max_turns=0",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "environment.max_turns: expected an int >= 1, got 0" in err
    assert "Traceback" not in err


class HintEnv(MultiTurnEnv):
    """Answers the first wrong turn with the example's ``hint`` column, up to ``max_hints``."""

    @checked_options
    def __init__(self, max_hints: Annotated[int, Field(ge=0)] = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_hints = max_hints

    def reset(self, example):
        return {"answer": example["answer"], "hint": example["hint"]}

    def env_response(self, messages, state, episode):
        if episode.num_turns > self.max_hints or state["answer"] in messages[-1]["content"]:
            return None
        return [{"role": "user", "content": f"Hint: {state['hint']}"}]


# (key, override, value, what is wrong): every option of ToolEnv, a bad value each.
BAD_TOOL_ENV_OPTIONS = [
    ("max_turns", "0", 0, "expected an int >= 1, got 0"),
    ("max_episode_tokens", "0", 0, "expected an int >= 1 or null, got 0"),
    ("max_tokens_per_turn", "true", True, "expected an int >= 1 or null, got True"),
    ("reward_timeout_s", "-1.0", -1.0, "expected a number > 0, got -1.0"),
    ("tool_timeout_s", "0", 0, "expected a number > 0, got 0"),
    ("max_tool_calls_per_turn", "0", 0, "expected an int >= 1, got 0"),
    ("tool_memory_mb", "10", 10, "expected an int >= 64 or null, got 10"),
    ("tool_workers", "0", 0, "expected an int >= 1, got 0"),
    ("call_format", "xml", "xml", f"expected one of {FORMATS}, got 'xml'"),
    ("stop", "</answer>", "</answer>", "expected a list of strings or null, got '</answer>'"),
]


def test_validate_refuses_the_environment_options_the_environment_refuses(tmp_path, capsys):
    """One source: the constructor's declarations; one line per option, from both."""
    from grpo.cli import main

    def validate(*overrides: str) -> str:
        status = main(["validate", "tiny_calculator_cpu", f"output_dir={tmp_path}/run", *overrides])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err
        return err

    err = validate(*(f"environment.{key}={text}" for key, text, _, _ in BAD_TOOL_ENV_OPTIONS))
    assert f"config has {len(BAD_TOOL_ENV_OPTIONS)} problems" in err
    for key, _, value, what in BAD_TOOL_ENV_OPTIONS:
        assert f"  - environment.{key}: {what}\n" in err
        with pytest.raises(ValueError) as refused:
            ToolEnv(tools=[calculator], **{key: value})
        assert str(refused.value) == f"ToolEnv: {key}: {what}"
    for turns in ("-1", "2.5"):
        assert f"environment.max_turns: expected an int >= 1, got {turns}" in validate(
            f"environment.max_turns={turns}"
        )
    # A subclass's options: its bases' (passed on through **kwargs) and its own.
    assert "environment.max_turns: expected an int >= 1, got 0" in validate(
        "environment={_component_: grpo.testing.tools.EchoUserEnv, max_turns: 0}"
    )
    assert option_problems(HintEnv, {"max_hints": -1, "stop": ["x"], "max_turns": 2.5}) == [
        "max_hints: expected an int >= 0, got -1",
        "max_turns: expected an int >= 1, got 2.5",
    ]
    with pytest.raises(ValueError, match="HintEnv: max_hints: expected an int >= 0, got -1"):
        HintEnv(max_hints=-1)


def test_an_environment_reads_the_other_columns_of_a_prompt_dataset(tmp_path, tokenizer):
    rows = [
        # "messages" and "index" are the example's own keys: such columns do not ride along.
        {"q": "What is 2+5?", "answer": 7, "hint": "add 2 and 5", "messages": "x", "index": 9},
    ]
    path = tmp_path / "hints.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    dataset = prompt_dataset(path, prompt_key="q", template="answer_only")
    [example] = PromptStream(dataset, 0, 1, seed=0).next_batch(1)  # as a collector takes it
    assert example["hint"] == "add 2 and 5" and example["index"] == 0
    assert "messages" not in example

    env = HintEnv(max_turns=3, reward_functions=[MathCorrectnessReward()])
    engine = ScriptedEngine(tokenizer, ["<answer>10</answer>", "<answer>7</answer>"])
    prompt_ids = tokenizer.encode(example["prompt"], add_bos=False, add_eos=False)
    [[episode]] = _run(env, engine, tokenizer, [(example, prompt_ids)])
    assert episode.error is None and episode.num_turns == 2
    assert {"role": "user", "content": "Hint: add 2 and 5"} in episode.messages


def test_a_group_whose_episodes_start_differently_keeps_each_prompt():
    """A failed first episode (no prompt) and episodes whose prompts differ in length or only in
    content: each trajectory carries its own prompt, equal prompts share one tensor."""
    from grpo.envs import Episode

    def episode(prompt_ids, error=None):
        result = Episode(example={"answer": "7"}, prompt_ids=list(prompt_ids), messages=[])
        result.error = error
        if error is None:
            result.add_policy_turn([9, 9], [-0.5, -0.5])
        return result

    group = [
        episode([], error="the episode failed"),
        episode([1, 2, 3, 4, 5]),
        episode([1, 2, 3]),
        episode([1, 2, 7]),
        episode([1, 2, 3]),
    ]
    [trajectories] = episode_groups(
        [group],
        [{"reward": 1.0}] * 4,
        group_ids=[5],
        sequence_id=iter(f"s{n}" for n in range(4)).__next__,
        policy_version=0,
    )
    kept = trajectories.trajectories
    assert [t.prompt_tokens.tolist() for t in kept] == [
        [1, 2, 3, 4, 5],
        [1, 2, 3],
        [1, 2, 7],
        [1, 2, 3],
    ]
    assert [t.prompt_len for t in kept] == [5, 3, 3, 3]
    assert kept[1].prompt_tokens is kept[3].prompt_tokens
