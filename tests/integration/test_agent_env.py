"""Agents as environments on the real engine: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_agent_env.py.
"""

from __future__ import annotations

import queue

import pytest

from grpo.envs import AgentEnv, ChatTurnRenderer
from grpo.envs.agent_env import AGENT_OVERRIDDEN_SAMPLING, AGENT_SPLITS
from grpo.testing import agents
from tests.unit import test_agent_env as fast
from tests.unit.test_agent_env import _runs

# Fixtures shared with the tests without Ray or vLLM.
family_dirs = fast.family_dirs


def _collector(model_dir, agent):
    from grpo.data import ChatTemplate, arithmetic_dataset
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    dataset = arithmetic_dataset(num_examples=8, seed=0, template=ChatTemplate(model_dir, stop=[]))
    env = AgentEnv(agent=agent, max_turns=3, agent_timeout_s=60)
    config = InferenceConfig(
        engine_args={"kv_cache_memory_bytes": 32 * 2**20, "max_model_len": 1024},
        group_size=4,
        max_generated_tokens=8,
        max_prompt_tokens=256,
    )
    return SyncLLMCollector(
        0, 1, model_dir, dataset, queue.Queue(), config, seed=0, environment=env
    )


def _batch(collector, agent, prompts=1):
    collector.environment.agent = agent
    agents.RECORDS.clear()
    metrics = collector.generate_batch(prompts)
    return metrics, [collector.rollout_queue.get(timeout=5) for _ in range(prompts)]


def _check_exact(groups, renderer, tokenizer):
    """Every trajectory is its calls' tokens: the first prompt, then each call's sampled tokens
    (trained) and the tool turn as the template writes it (masked)."""
    by_sequence = {tuple(calls[-1][0] + calls[-1][1]): calls for calls in agents.RECORDS}
    for group in groups:
        assert len(group.trajectories) == 4
        for trajectory in group.trajectories:
            prompt = trajectory.prompt_tokens.tolist()
            response = trajectory.response_tokens.tolist()
            calls = by_sequence[tuple(prompt + response)]
            (prompt1, sampled1), (prompt2, sampled2) = calls
            closed = sampled1[-1] in tokenizer.stop_tokens
            bridge = renderer.env_tokens([{"role": "tool", "content": "42"}], closed)
            assert prompt == prompt1 and prompt2 == prompt1 + sampled1 + bridge
            assert _runs(response, trajectory.response_mask.tolist()) == [
                (True, sampled1),
                (False, bridge),
                (True, sampled2),
            ]


@pytest.mark.slow
@pytest.mark.parametrize("template", ["qwen3", "llama3_1"])
def test_the_real_engine_trains_the_sampled_tokens_and_masks_the_tool_turns(family_dirs, template):
    collector = _collector(family_dirs[template], agents.tool_agent)
    try:
        metrics, groups = _batch(collector, agents.tool_agent)
        assert metrics["inference/episodes_dropped"] == 0 and metrics[AGENT_SPLITS] == 0
        renderer = ChatTurnRenderer(collector.tokenizer)
        _check_exact(groups, renderer, collector.tokenizer)
        if template == "qwen3":  # the other routes, once
            metrics, groups = _batch(collector, agents.streaming_agent)
            assert metrics[AGENT_OVERRIDDEN_SAMPLING] == 4
            metrics, groups = _batch(collector, agents.completion_agent)
            for calls in agents.RECORDS:
                (prompt1, sampled1), (prompt2, _) = calls
                assert prompt2[: len(prompt1) + len(sampled1)] == prompt1 + sampled1
            assert all(t.prompt_tokens.tolist() == [1, 2, 3, 4] for t in groups[0].trajectories)
            metrics, groups = _batch(collector, agents.rewriting_agent)
            assert metrics[AGENT_SPLITS] == 4 and len(groups[0].trajectories) == 8
            collector.environment.agent = agents.raising_agent
            metrics = collector.generate_batch(1)
            assert metrics["inference/agent_errors_raised"] == 4
            assert metrics["inference/episodes_dropped"] == 4
    finally:
        collector.shutdown()
