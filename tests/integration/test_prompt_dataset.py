"""Prompts from the model's chat template through vLLM and a collector: the tests that start a Ray
cluster or a vLLM engine.

The tests without either: tests/unit/test_prompt_dataset.py.
"""

from __future__ import annotations

import pickle

import pytest

from grpo.data import (
    THINK_ANSWER_INSTRUCTION,
    ChatTemplate,
    prompt_dataset,
)
from tests.unit import test_prompt_dataset as fast
from tests.unit.test_prompt_dataset import (
    CONVERSATION,
    _write_jsonl,
)

# Fixtures shared with the tests without Ray or vLLM.
llama3_dir = fast.llama3_dir
qwen25_dir = fast.qwen25_dir


@pytest.mark.slow
def test_rendered_prompt_token_ids_match_vllm(qwen25_dir, llama3_dir):
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    from grpo.models import load_tokenizer

    question = "Natalia sold 48 clips in April, and half as many in May. How many in all?"
    qwen_prompt = ChatTemplate(qwen25_dir, system_prompt=THINK_ANSWER_INSTRUCTION)(question)
    vllm_qwen = get_tokenizer(str(qwen25_dir))
    assert load_tokenizer(qwen25_dir).encode(qwen_prompt, add_bos=False, add_eos=False) == (
        vllm_qwen.encode(qwen_prompt, add_special_tokens=False)
    )
    llama_prompt = ChatTemplate(llama3_dir)(CONVERSATION)
    vllm_llama = get_tokenizer(str(llama3_dir))
    hf_llama = AutoTokenizer.from_pretrained(llama3_dir)
    ids = vllm_llama.encode(llama_prompt, add_special_tokens=False)
    assert ids == hf_llama.encode(llama_prompt, add_special_tokens=False)
    assert ids.count(hf_llama.convert_tokens_to_ids("<|begin_of_text|>")) == 1


@pytest.mark.slow
def test_collector_generates_from_chat_turns(tmp_path, qwen25_dir):
    import queue

    from grpo.rewards import MathCorrectnessReward
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    rows = [
        {"messages": CONVERSATION, "answer": "8"},
        {"question": "What is 1 + 2?", "answer": "3"},
    ]
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": r.get("messages") or r["question"], "answer": r["answer"]} for r in rows],
    )
    dataset = prompt_dataset(
        path, template=ChatTemplate(qwen25_dir, system_prompt=THINK_ANSWER_INSTRUCTION)
    )
    config = InferenceConfig(
        engine_args={"kv_cache_memory_bytes": 64 * 2**20},
        group_size=2,
        max_generated_tokens=8,
        max_prompt_tokens=512,
    )
    collector = SyncLLMCollector(
        0,
        1,
        qwen25_dir,
        pickle.loads(pickle.dumps(dataset)),
        queue.Queue(),
        config,
        seed=0,
        reward_functions=[MathCorrectnessReward()],
    )
    try:
        assert collector.sampling.stop == ("</answer>",)
        assert collector.environment.context.add_bos is False
        collector.generate_batch(2)
        groups = [collector.rollout_queue.get(timeout=30) for _ in range(2)]
        expected = {
            tuple(collector.tokenizer.encode(dataset.prompt(i), add_bos=False, add_eos=False))
            for i in range(2)
        }
        assert {tuple(g.trajectories[0].prompt_tokens.tolist()) for g in groups} == expected
        completions = collector.evaluate([dataset[0], dataset[1]], max_generated_tokens=4)
        assert len(completions) == 2
    finally:
        collector.shutdown()
