"""Environment turns on each family's published chat template, played by a real collector: the tests
that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_chat_families.py.
"""

from __future__ import annotations

import queue

import pytest

from grpo.envs import ChatTurnRenderer
from grpo.observability.metric_names import INFERENCE_EPISODES_DROPPED
from grpo.rewards import MathCorrectnessReward
from grpo.testing.tools import EchoUserEnv
from tests.unit import test_chat_families as fast

# Fixtures shared with the tests without Ray or vLLM.
family_dirs = fast.family_dirs


@pytest.mark.slow
@pytest.mark.parametrize("template", ["qwen3", "llama3_1", "deepseek_r1_distill_qwen"])
def test_collector_plays_user_reply_episodes_on_the_family_model(family_dirs, template):
    """The real engine: every episode is kept, and its response is the sampled turns with the
    template's user turns between them."""
    from grpo.data import ChatTemplate, arithmetic_dataset
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    model_dir = family_dirs[template]
    dataset = arithmetic_dataset(num_examples=8, seed=0, template=ChatTemplate(model_dir, stop=[]))
    env = EchoUserEnv(max_turns=2, stop=[" ", "e", "a"], reward_functions=[MathCorrectnessReward()])
    config = InferenceConfig(
        engine_args={"kv_cache_memory_bytes": 32 * 2**20, "max_model_len": 512},
        group_size=4,
        max_generated_tokens=8,
        max_prompt_tokens=256,
    )
    collector = SyncLLMCollector(
        0, 1, model_dir, dataset, queue.Queue(), config, seed=0, environment=env
    )
    try:
        metrics = collector.generate_batch(2)
        groups = [collector.rollout_queue.get(timeout=5) for _ in range(2)]
    finally:
        collector.shutdown()
    assert metrics[INFERENCE_EPISODES_DROPPED] == 0
    tokenizer = collector.tokenizer
    renderer = ChatTurnRenderer(tokenizer)
    two_turn = 0
    for group in groups:
        assert len(group.trajectories) == 4
        for trajectory in group.trajectories:
            runs = []
            for token, trained in zip(
                trajectory.response_tokens.tolist(), trajectory.response_mask.tolist()
            ):
                if runs and runs[-1][0] == trained:
                    runs[-1][1].append(token)
                else:
                    runs.append((trained, [token]))
            if len(runs) == 3:  # a first turn that ended on a stop string, a reply, a turn
                two_turn += 1
                first = runs[0][1]
                closed = first[-1] in tokenizer.stop_tokens
                assert runs[1][1] == renderer.env_tokens(
                    [{"role": "user", "content": "again"}], closed
                )
    assert two_turn > 0
