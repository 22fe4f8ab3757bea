"""GSM8K-length prompts on the CPU engine: every request seeded, many samples per prompt.

With chunked prefill, vLLM 0.32 splits a step's prompts at its token budget and then rewinds
the seeded sampler of the split request, which the CPU generator cannot do ("CPU Generator
does not use offset"). The collector's CPU default keeps every prefill whole.
"""

from __future__ import annotations

import queue

import pytest

from grpo.rewards import MathCorrectnessReward
from grpo.workers.collector import InferenceConfig, SyncLLMCollector
from grpo.workers.vllm_engine import whole_prefills

pytestmark = pytest.mark.slow

QUESTION = (
    "Natalia sold clips to {n} of her friends in April, and then she sold half as many clips "
    "in May. Each clip costs three dollars and every friend paid with a ten dollar bill. How "
    "many clips did Natalia sell altogether in April and May, and how much change did she "
    "give back to her friends in total? Show your reasoning step by step."
)


def test_a_batch_of_long_seeded_prompts_generates(tiny_model_dir):
    items = [{"index": i, "question": QUESTION.format(n=i + 40), "answer": "1"} for i in range(16)]
    for item in items:
        item["prompt"] = item["question"]
    config = InferenceConfig(
        group_size=16,
        max_generated_tokens=8,
        max_prompt_tokens=256,
        engine_args={"kv_cache_memory_bytes": 256 * 2**20, "max_num_seqs": 128},
    )
    rollout_queue: queue.Queue = queue.Queue()
    collector = SyncLLMCollector(
        0,
        1,
        tiny_model_dir,
        items,
        rollout_queue,
        config,
        seed=0,
        reward_functions=[MathCorrectnessReward()],
    )
    try:
        prompt_len = len(collector.environment.prompt_ids(items[0]))
        assert prompt_len >= 80
        # 8 prompts x 16 samples: far more prompt tokens than one step's budget of 4096.
        assert 8 * 16 * prompt_len > 4096
        metrics = collector.generate_batch(8)
    finally:
        collector.shutdown()
    assert metrics["inference/num_groups"] == 8.0
    groups = [rollout_queue.get_nowait() for _ in range(8)]
    assert all(len(group.trajectories) == 16 for group in groups)
    assert whole_prefills({"max_model_len": 264}, str(tiny_model_dir)) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
    }
