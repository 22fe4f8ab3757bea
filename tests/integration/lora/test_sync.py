"""Adapter-only weight sync: a collector's vLLM engine serves each policy version as a LoRA
adapter, verified by checksum and probe, and never changes the adapter under a running request;
or, served merged, folds each adapter into the base weights and computes with exactly them.

Real vLLM CPU engines with the tiny Qwen2 model: one with LoRA kernels (punica_cpu), one
without (merged).
"""

from __future__ import annotations

import queue

import pytest
import torch

from grpo.config import InferenceConfig, LoRAConfig
from grpo.rewards import MathCorrectnessReward
from grpo.weights.checksum import NO_ADAPTER_CHECKSUM, state_dict_checksum

pytestmark = pytest.mark.slow  # a real vLLM engine

LORA = LoRAConfig(
    rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], serve="adapter"
)
MERGED = LORA.model_copy(update={"serve": "merged"})


def trainer_side(model_dir, seed: int):
    """A LoRA model as the trainer holds it, its adapter moved away from zero by ``seed``."""
    from grpo.models import build_model, load_hf_config
    from grpo.models.lora import apply_lora, lora_modules

    model = build_model(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    apply_lora(model, LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_b.weight.copy_(
                0.5 * torch.randn(module.lora_b.weight.shape, generator=generator)
            )
    return model, load_hf_config(model_dir)


def update_of(model, hf_config, version: int) -> dict:
    """What the trainer publishes: PEFT-named adapter tensors, their checksum, the probe."""
    from grpo.models.lora import adapter_state_dict, peft_adapter_state_dict

    peft = peft_adapter_state_dict(adapter_state_dict(model.state_dict()), hf_config)
    token_ids = [(7 * i + 3) % 256 for i in range(16)]
    return {
        "weights": peft,
        "version": version,
        "checksum": state_dict_checksum(peft),
        "probe": {
            "token_ids": token_ids,
            "logprobs": forward_logprobs(model, torch.tensor(token_ids)).tolist(),
            "atol": 1e-3,
        },
    }


def forward_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens[None])[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[1:, None])[:, 0]


def dataset():
    from grpo.data import AnswerOnlyTemplate, PromptDataset

    examples = [{"question": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(8)]
    return PromptDataset(examples, AnswerOnlyTemplate())


def start_collector(model_dir, lora: LoRAConfig):
    from grpo.workers.collector import SyncLLMCollector

    config = InferenceConfig(
        engine_args={"kv_cache_memory_bytes": 64 * 2**20},
        group_size=2,
        max_generated_tokens=48,
        max_prompt_tokens=128,
        weight_updates="in_flight",
    )
    return SyncLLMCollector(
        0,
        1,
        model_dir,
        dataset(),
        queue.Queue(),
        config,
        seed=0,
        reward_functions=[MathCorrectnessReward()],
        lora=lora,
    )


@pytest.fixture(scope="module")
def collector(tiny_model_dir):
    collector = start_collector(tiny_model_dir, LORA)
    yield collector
    collector.shutdown()


def engine_logprobs(collector, tokens: list[int]) -> torch.Tensor:
    return torch.tensor(collector.probe_logprobs(tokens))


def test_engine_serves_each_verified_adapter_and_rejects_a_wrong_one(collector, tiny_model_dir):
    from grpo.models import build_model

    tokens = [(5 * i + 11) % 256 for i in range(24)]
    base = forward_logprobs(build_model(tiny_model_dir).eval(), torch.tensor(tokens))
    # Version 0 is the base model, with no adapter.
    assert collector.get_weights_checksum() == NO_ADAPTER_CHECKSUM
    assert torch.allclose(engine_logprobs(collector, tokens), base, atol=1e-3)

    model_1, hf_config = trainer_side(tiny_model_dir, seed=1)
    update_1 = update_of(model_1, hf_config, version=1)
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in update_1["weights"])
    assert collector.receive_weights(**update_1)
    collector.apply_pending_weights()
    assert collector.policy_version == 1
    assert collector.get_weights_checksum() == update_1["checksum"]
    ours_1 = forward_logprobs(model_1, torch.tensor(tokens))
    served = engine_logprobs(collector, tokens)
    assert (served - base).abs().max() > 0.05  # the adapter changes the model...
    assert torch.allclose(served, ours_1, atol=1e-3)  # ...into exactly the trainer's
    [adapter_1] = collector.engine.llm.llm_engine.list_loras()

    # An update whose tensors are not the adapter the trainer probed: the probe catches it,
    # the engine keeps serving version 1.
    model_2, _ = trainer_side(tiny_model_dir, seed=2)
    wrong = update_of(model_2, hf_config, version=2)
    wrong["probe"] = update_1["probe"] | {"logprobs": ours_1.tolist()[:15]}
    wrong["probe"]["token_ids"] = tokens[:16]
    assert collector.receive_weights(**wrong)
    collector.apply_pending_weights()
    assert collector.policy_version == 1
    assert collector.weights.totals["weight_updates_rejected"] == 1
    assert torch.allclose(engine_logprobs(collector, tokens), ours_1, atol=1e-3)
    assert collector.engine.llm.llm_engine.list_loras() == {adapter_1}

    # A good version 3: a new adapter id, the old adapter removed from the engine.
    model_3, _ = trainer_side(tiny_model_dir, seed=3)
    update_3 = update_of(model_3, hf_config, version=3)
    assert collector.receive_weights(**update_3)
    collector.apply_pending_weights()
    assert collector.policy_version == 3
    assert collector.engine.llm.llm_engine.list_loras() == {3}
    served_3 = engine_logprobs(collector, tokens)
    assert torch.allclose(served_3, forward_logprobs(model_3, torch.tensor(tokens)), atol=1e-3)


def test_running_requests_keep_their_adapter_and_are_labelled_with_its_version(
    collector, tiny_model_dir
):
    """An update in flight: requests that started before it sample on with their adapter
    (every token labelled with its version); requests added after get the new one."""
    from grpo.envs import SampleRequest

    start = collector.policy_version
    model, hf_config = trainer_side(tiny_model_dir, seed=10 + start)
    engine = collector.engine
    with engine.batch():
        turns = engine.turn_engine()
        for j in range(2):
            turns.submit(
                SampleRequest([1, 2, 3, 4 + j], max_tokens=48, seed=j, stop=()), f"old-{j}"
            )
        finished = dict(turns.step())  # one step: the requests run with version `start`
        assert not finished
        collector.receive_weights(**update_of(model, hf_config, version=start + 1))
        finished.update(turns.step())  # the update loads between two steps
        assert collector.policy_version == start + 1
        turns.submit(SampleRequest([1, 2, 3, 9], max_tokens=16, seed=5, stop=()), "new")
        while len(finished) < 3:
            finished.update(turns.step())
    for key in ("old-0", "old-1"):
        [(version, count)] = finished[key].version_runs
        assert version == start and count == len(finished[key].token_ids)
    [(version, _)] = finished["new"].version_runs
    assert version == start + 1
    # The old adapter left the engine once its last request finished.
    assert engine.llm.llm_engine.list_loras() == {start + 1}


def merged_weights(model, hf_config) -> dict:
    """The trainer's model with its adapter folded in by torchtune's own formula, under HF
    names: what a collector serving it merged must load."""
    from grpo.models import tune_to_hf_state_dict
    from grpo.models.lora import merge_lora

    return tune_to_hf_state_dict(merge_lora(model.state_dict(), LORA), hf_config)


def test_served_merged_the_engine_computes_with_exactly_base_plus_scaled_b_a(tiny_model_dir):
    """``serve: merged``: vLLM runs without LoRA; each verified adapter is folded into the base
    weights, and the engine's checksum of what it loaded is that of W + (alpha / r) B A."""
    from grpo.models import build_model

    collector = start_collector(tiny_model_dir, MERGED)
    try:
        llm = collector.engine.llm
        assert llm.llm_engine.vllm_config.lora_config is None  # no LoRA kernels
        tokens = [(5 * i + 11) % 256 for i in range(24)]
        base = forward_logprobs(build_model(tiny_model_dir).eval(), torch.tensor(tokens))
        assert collector.get_weights_checksum() == NO_ADAPTER_CHECKSUM
        assert torch.allclose(engine_logprobs(collector, tokens), base, atol=1e-3)

        model_1, hf_config = trainer_side(tiny_model_dir, seed=1)
        update_1 = update_of(model_1, hf_config, version=1)
        assert collector.receive_weights(**update_1)
        collector.apply_pending_weights()
        assert collector.policy_version == 1
        # The driver's check compares the adapter's checksum, as the trainer computes it...
        assert collector.get_weights_checksum() == update_1["checksum"]
        # ...and the engine holds exactly base + (alpha / rank) * B @ A.
        expected_1 = state_dict_checksum(merged_weights(model_1, hf_config))
        assert llm.collective_rpc("grpo_weights_checksum") == [expected_1]
        served = engine_logprobs(collector, tokens)
        assert (served - base).abs().max() > 0.05
        assert torch.allclose(served, forward_logprobs(model_1, torch.tensor(tokens)), atol=1e-3)

        # An adapter that is not the one the sender hashed is rejected before it is merged;
        # one whose probe disagrees is loaded, rejected and rolled back.
        model_2, _ = trainer_side(tiny_model_dir, seed=2)
        corrupted = update_of(model_2, hf_config, version=2)
        name = next(n for n in corrupted["weights"] if n.endswith("lora_B.weight"))
        corrupted["weights"] = dict(corrupted["weights"])
        corrupted["weights"][name] = corrupted["weights"][name] + 1e-3
        wrong_probe = update_of(model_2, hf_config, version=3)
        wrong_probe["probe"] = update_1["probe"]
        for rejected, update in enumerate((corrupted, wrong_probe), start=1):
            assert collector.receive_weights(**update)
            with collector.engine.lock:  # in flight: the update loads before the next step
                collector.engine.step()
            assert collector.policy_version == 1
            assert collector.weights.totals["weight_updates_rejected"] == rejected
        assert llm.collective_rpc("grpo_weights_checksum") == [expected_1]
        assert collector.get_weights_checksum() == update_1["checksum"]

        model_4, _ = trainer_side(tiny_model_dir, seed=4)
        update_4 = update_of(model_4, hf_config, version=4)
        assert collector.receive_weights(**update_4)
        collector.apply_pending_weights()
        assert collector.policy_version == 4
        assert llm.collective_rpc("grpo_weights_checksum") == [
            state_dict_checksum(merged_weights(model_4, hf_config))
        ]
        served_4 = engine_logprobs(collector, tokens)
        assert torch.allclose(served_4, forward_logprobs(model_4, torch.tensor(tokens)), atol=1e-3)
    finally:
        collector.shutdown()
