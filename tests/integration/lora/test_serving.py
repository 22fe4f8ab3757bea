"""vLLM serves the PEFT folder of a trained LoRA adapter with our model's logprobs, and the base
model's without it (tiny Qwen2, Qwen3 and Llama; vLLM CPU with its LoRA kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torchtune.modules.peft import disable_adapter

from grpo import models
from grpo.models.lora import (
    adapter_state_dict,
    peft_adapter_config,
    peft_adapter_state_dict,
    save_peft_adapter,
)
from tests.unit.lora.test_model import (
    BUILDERS,
    CONFIG,
    FAMILIES,
    logits,
    lora_model,
    tokens,
    train_adapter,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family (read-only)."""
    root = tmp_path_factory.mktemp("lora_families")
    return {family: BUILDERS[family](root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_the_peft_folder_with_our_logprobs(family, family_dirs, tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from grpo.testing import set_vllm_cpu_env, tiny_vllm_engine_kwargs

    model_dir = family_dirs[family]
    hf_config = models.load_hf_config(model_dir)
    model = lora_model(model_dir)
    train_adapter(model)
    peft_dir = save_peft_adapter(
        tmp_path / "adapter",
        peft_adapter_state_dict(adapter_state_dict(model.state_dict()), hf_config),
        peft_adapter_config(CONFIG, model_dir),
    )
    prompt = tokens(length=32, seed=7)[0].tolist()
    target = torch.tensor(prompt[1:])

    def ours(m: nn.Module) -> torch.Tensor:
        logprobs = torch.log_softmax(logits(m, torch.tensor([prompt]))[0, :-1], dim=-1)
        return logprobs.gather(-1, target[:, None])[:, 0]

    with_adapter = ours(model)
    with disable_adapter(model):
        without = ours(model)
    assert (with_adapter - without).abs().max() > 1e-2  # the adapter matters

    set_vllm_cpu_env()
    llm = LLM(
        model=str(model_dir),
        enable_lora=True,
        max_lora_rank=8,
        **tiny_vllm_engine_kwargs(max_model_len=256, kv_cache_mib=256),
    )
    try:

        def served(lora_request: LoRARequest | None) -> torch.Tensor:
            [output] = llm.generate(
                [TokensPrompt(prompt_token_ids=prompt)],
                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                lora_request=lora_request,
                use_tqdm=False,
            )
            entries = output.prompt_logprobs[1:]
            return torch.tensor([entry[t].logprob for entry, t in zip(entries, prompt[1:])])

        torch.testing.assert_close(
            served(LoRARequest("a", 1, str(peft_dir))), with_adapter, rtol=0, atol=1e-3
        )
        torch.testing.assert_close(served(None), without, rtol=0, atol=1e-3)
    finally:
        llm.llm_engine.engine_core.shutdown()
