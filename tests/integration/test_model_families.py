"""The model families Qwen2, Qwen3 and Llama 3 in vLLM and in a short run: the tests that start a Ray
cluster or a vLLM engine.

The tests without either: tests/unit/test_model_families.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo import models
from grpo.testing import RANDOM_MODEL_OVERRIDES
from tests.unit import test_model_families as fast
from tests.unit.test_model_families import (
    FAMILIES,
    perturbed_state_dict,
    random_tokens,
    sequence_logprobs,
)

# Fixtures shared with the tests without Ray or vLLM.
family_dirs = fast.family_dirs


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, family_dirs):
    """``(llm, model_dir, family)``: a vLLM CPU engine started as the collectors start theirs
    (the weight-sync worker extension, raw logprobs), one family at a time."""
    from vllm import LLM

    from grpo.testing import set_vllm_cpu_env
    from grpo.workers.vllm_engine import engine_kwargs

    set_vllm_cpu_env()
    model_dir = family_dirs[request.param]
    engine_args = {"kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 512, "max_num_seqs": 8}
    llm = LLM(model=str(model_dir), **engine_kwargs(engine_args, seed=0, on_cpu=True))
    yield llm, model_dir, request.param
    llm.llm_engine.engine_core.shutdown()


def vllm_sequence_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    [output] = llm.generate(
        [TokensPrompt(prompt_token_ids=token_ids)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    return torch.tensor(
        [entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], token_ids[1:])]
    )


@pytest.mark.slow
def test_vllm_greedy_decoding_and_logprobs_match_torchtune(engine) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, model_dir, _ = engine
    model = models.build_model(model_dir).eval()
    prompt = random_tokens(20, seed=1)[0].tolist()
    [output] = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    generated = list(output.outputs[0].token_ids)
    # Greedy decoding with our model, one full forward per step.
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    assert generated == tokens[len(prompt) :]
    # The sampled tokens' logprobs, and a longer sequence's prompt logprobs, agree too.
    sampled = torch.tensor([lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, generated)])
    ours = sequence_logprobs(model, prompt + generated)[len(prompt) - 1 :]
    torch.testing.assert_close(sampled, ours, rtol=0, atol=1e-3)
    long = random_tokens(300, seed=2)[0].tolist()
    expected = sequence_logprobs(model, long)
    torch.testing.assert_close(vllm_sequence_logprobs(llm, long), expected, rtol=0, atol=1e-3)
    assert expected.std() > 0.5


@pytest.mark.slow
def test_vllm_in_place_weight_update_passes_checksum_and_probe(engine) -> None:
    from grpo.weights.checksum import state_dict_checksum
    from grpo.weights.engine import WeightReceiver, WeightUpdate

    llm, model_dir, family = engine
    config = models.load_hf_config(model_dir)
    model = models.build_model(model_dir).eval()
    # Before any update the engine holds the folder's tensors: the trainer's conversion of
    # its state dict (q/k permuted back for Llama) hashes to the same checksum.
    initial = models.tune_to_hf_state_dict(model.state_dict(), config)
    assert llm.collective_rpc("grpo_weights_checksum") == [state_dict_checksum(initial)]

    probe = random_tokens(200, seed=3)[0].tolist()
    before = vllm_sequence_logprobs(llm, probe)
    model.load_state_dict(perturbed_state_dict(model, seed=5))
    weights = {k: v.clone() for k, v in models.hf_weight_iterator(model.state_dict(), config)}
    receiver = WeightReceiver()
    checksum = state_dict_checksum(weights)
    assert receiver.offer(WeightUpdate(version=1, weights=weights, checksum=checksum), 0)
    applied = receiver.apply_pending(llm)  # raises WeightSyncError on a checksum mismatch
    assert applied is not None and applied.version == 1
    assert llm.collective_rpc("grpo_weights_checksum") == [checksum]
    # The probe: the engine now computes the trainer's logprobs, and not the old ones.
    after = vllm_sequence_logprobs(llm, probe)
    torch.testing.assert_close(after, sequence_logprobs(model, probe), rtol=0, atol=1e-3)
    assert (after - before).abs().max() > 0.05, family

    # Restore the checkpoint's weights for the module's other tests.
    original = models.load_hf_state_dict(model_dir)
    restore = WeightUpdate(version=2, weights=original, checksum=state_dict_checksum(original))
    assert receiver.offer(restore, 1)
    receiver.apply_pending(llm)


def base_keys(model_dir: Path) -> set[str]:
    return set(models.build_model(model_dir, device="meta", load_weights=False).state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_short_grpo_run(family: str, family_dirs, tmp_path, monkeypatch, ray_shared) -> None:
    from grpo.cli import main as grpo_main
    from grpo.testing import read_jsonl

    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    num_steps = 2
    overrides = [
        f"base_model_path={family_dirs[family]}",
        *RANDOM_MODEL_OVERRIDES,
        f"output_dir={run_dir}",
        f"orchestration.num_steps={num_steps}",
        "eval_every_n_steps=null",
        "inference.batch_size=2",
        "training.batch_size=16",
    ]
    assert grpo_main(["run", "async_grpo", "--config", "tiny_arithmetic_cpu", *overrides]) == 0

    trained = read_jsonl(run_dir / "trained.jsonl")
    assert [record["step"] for record in trained] == list(range(1, num_steps + 1))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    versions = [r["training/policy_version"] for r in metrics if "training/policy_version" in r]
    assert versions == [float(step) for step in range(num_steps)]
    # The collector computes with exactly the trainer's weights after the last sync.
    in_sync = [(r["step"], r["weight_sync/in_sync"]) for r in metrics if "weight_sync/in_sync" in r]
    assert in_sync == [(num_steps, 1.0)]
    # The final checkpoint is a folder of the same family that loads back. (Its weights may
    # equal the base's: a random tiny model rarely earns a reward, so advantages can be 0.)
    final = run_dir / "final"
    assert models.load_hf_config(final)["model_type"] == family
    assert models.build_model(final).state_dict().keys() == base_keys(family_dirs[family])
