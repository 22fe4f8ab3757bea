"""The shipped demo model served by vLLM: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_demo_model.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from grpo.models import build_model, load_tokenizer
from grpo.testing import set_vllm_cpu_env, tiny_vllm_engine_kwargs
from tests.helpers.scripts import load_script
from tests.unit import test_demo_model as fast
from tests.unit.test_demo_model import (
    ACCURACY_RANGE,
    MODEL_DIR,
    accuracy_and_format,
)

# Fixtures shared with the tests without Ray or vLLM.
eval_items = fast.eval_items


@pytest.mark.slow
def test_vllm_greedy_accuracy_in_range(eval_items: list[dict[str, str]]) -> None:
    set_vllm_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = load_tokenizer(MODEL_DIR)
    prompts = [tokenizer.encode(item["prompt"], add_bos=True, add_eos=False) for item in eval_items]
    llm = LLM(model=str(MODEL_DIR), **tiny_vllm_engine_kwargs(max_model_len=128))
    try:
        # The demo evaluator's sampling: greedy, stop after "</answer>" or a stop token.
        params = SamplingParams(
            n=1,
            max_tokens=24,
            temperature=0.0,
            stop=["</answer>"],
            include_stop_str_in_output=True,
            stop_token_ids=list(tokenizer.stop_tokens),
        )
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False
        )
        completions = [
            tokenizer.decode(list(out.outputs[0].token_ids), skip_special_tokens=True)
            for out in outputs
        ]
    finally:
        del llm
        gc.collect()

    accuracy, format_rate = accuracy_and_format(completions, eval_items)
    assert ACCURACY_RANGE[0] <= accuracy <= ACCURACY_RANGE[1], accuracy
    assert format_rate >= 0.95, format_rate
    # vLLM and torchtune compute the same model: greedy answers agree on almost every prompt.
    model = build_model(MODEL_DIR).eval()
    with torch.no_grad():
        tune_completions = load_script("build_tiny_arithmetic_model").greedy_completions(
            model, prompts, tokenizer
        )
    tune_answers = [c.replace("<|im_end|>", "") for c in tune_completions]
    agree = sum(a == b for a, b in zip(completions, tune_answers))
    assert agree >= 0.95 * len(prompts), agree
