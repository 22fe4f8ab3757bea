"""The tiny models in vLLM (generation, tokenizer, logprobs, weight loading, saved checkpoints):
the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_models.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo import models
from grpo.testing import (
    set_vllm_cpu_env,
    tiny_vllm_engine_kwargs,
)
from tests.unit.test_models import (
    TEXTS,
    perturbed_state_dict,
)


def torchtune_logprobs(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Logprob of token t given tokens < t, for t = 1..len-1 (fp32)."""
    tokens = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(tokens)
    logprobs = torch.log_softmax(logits.float(), dim=-1)[0, :-1]
    return logprobs.gather(-1, tokens[0, 1:, None])[:, 0]


def make_llm(model_dir: Path):
    set_vllm_cpu_env()
    from vllm import LLM

    return LLM(model=str(model_dir), **tiny_vllm_engine_kwargs())


def vllm_prompt_logprobs(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    return [
        torch.tensor(
            [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], ids[1:])]
        )
        for out, ids in zip(outputs, sequences)
    ]


def random_sequences(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 64, 400)]


@pytest.fixture(scope="module", params=["tied", "untied"])
def engine(request, tiny_model_dir: Path, tiny_untied_model_dir: Path):
    model_dir = tiny_model_dir if request.param == "tied" else tiny_untied_model_dir
    llm = make_llm(model_dir)
    yield llm, model_dir
    del llm
    gc.collect()


@pytest.mark.slow
def test_vllm_generates_from_built_folder(engine) -> None:
    from vllm import SamplingParams

    llm, model_dir = engine
    tune_tok = models.load_tokenizer(model_dir)
    prompt = "What is 37 + 48?"
    outputs = llm.generate(
        [prompt], SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=0), use_tqdm=False
    )
    # vLLM tokenizes the prompt exactly like torchtune does.
    assert outputs[0].prompt_token_ids == tune_tok.encode(prompt, add_bos=False, add_eos=False)
    samples = outputs[0].outputs
    assert len(samples) == 4
    for sample in samples:
        assert 1 <= len(sample.token_ids) <= 16
        assert all(
            0 <= t < models.load_hf_config(model_dir)["vocab_size"] for t in sample.token_ids
        )
    assert len({tuple(s.token_ids) for s in samples}) > 1  # sampling explores


@pytest.mark.slow
def test_vllm_tokenizer_matches_torchtune(engine) -> None:
    llm, model_dir = engine
    tune_tok = models.load_tokenizer(model_dir)
    vllm_tok = llm.get_tokenizer()
    for text in TEXTS:
        ids = tune_tok.encode(text, add_bos=False, add_eos=False)
        assert vllm_tok.encode(text, add_special_tokens=False) == ids, text
        assert vllm_tok.decode(ids) == tune_tok.decode(ids)


@pytest.mark.slow
def test_vllm_prompt_logprobs_match_torchtune(engine) -> None:
    llm, model_dir = engine
    model = models.build_model(model_dir).eval()
    sequences = random_sequences(models.load_hf_config(model_dir)["vocab_size"])
    all_logprobs = []
    for ids, vllm_lp in zip(sequences, vllm_prompt_logprobs(llm, sequences)):
        tune_lp = torchtune_logprobs(model, ids)
        torch.testing.assert_close(vllm_lp, tune_lp, rtol=0, atol=1e-3)
        all_logprobs.append(tune_lp)
    # Logprobs spread over several nats, so a misplaced weight could not hide in the tolerance.
    assert torch.cat(all_logprobs).std() > 0.5


@pytest.mark.slow
def test_vllm_sampled_logprobs_match_torchtune(engine) -> None:
    from vllm import SamplingParams

    from grpo.workers.vllm_engine import sampled_logprobs

    llm, model_dir = engine
    model = models.build_model(model_dir).eval()
    tune_tok = models.load_tokenizer(model_dir)
    prompt_ids = tune_tok.encode(
        "<|im_start|>user\nWhat is 37 + 48?<|im_end|>\n", add_bos=False, add_eos=False
    )
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids)],
        SamplingParams(n=3, max_tokens=24, temperature=1.0, logprobs=0, seed=1),
        use_tqdm=False,
    )
    # The collector's reading of them: FlatLogprobs (``flat_logprobs=True``, three lists).
    flat = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids)],
        SamplingParams(n=3, max_tokens=24, temperature=1.0, logprobs=0, seed=1, flat_logprobs=True),
        use_tqdm=False,
    )
    for sample, flat_sample in zip(outputs[0].outputs, flat[0].outputs):
        response = list(sample.token_ids)
        vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, response)])
        tune_lp = torchtune_logprobs(model, prompt_ids + response)[len(prompt_ids) - 1 :]
        torch.testing.assert_close(vllm_lp, tune_lp, rtol=0, atol=1e-3)
        assert type(flat_sample.logprobs).__name__ == "FlatLogprobs"
        assert list(flat_sample.token_ids) == response
        flat_lp = torch.tensor(sampled_logprobs(flat_sample, "test"))
        torch.testing.assert_close(flat_lp, vllm_lp, rtol=0, atol=0)
    flat_sample.logprobs.token_ids[0] += 1  # no longer the sampled token's entry
    with pytest.raises(RuntimeError, match="not those of the sampled tokens"):
        sampled_logprobs(flat_sample, "test")


def _reload_weights_in_worker(worker, hf_pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker: in-place reload under HF names, as weight sync does."""
    worker.model_runner.reload_weights(weights_iterator=iter(hf_pairs))
    # On CPU, a tied lm_head keeps a packed copy of the old embedding unless re-processed.
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


@pytest.mark.slow
def test_vllm_accepts_hf_weight_iterator(engine) -> None:
    llm, model_dir = engine
    config = models.load_hf_config(model_dir)
    model = models.build_model(model_dir).eval()
    sequences = random_sequences(config["vocab_size"])
    before = vllm_prompt_logprobs(llm, sequences)

    new_state = perturbed_state_dict(model, seed=5)
    model.load_state_dict(new_state)
    llm.collective_rpc(
        _reload_weights_in_worker, args=(list(models.hf_weight_iterator(new_state, config)),)
    )
    llm.reset_prefix_cache()  # cached KV was computed with the old weights
    after = vllm_prompt_logprobs(llm, sequences)
    for ids, old_lp, new_lp in zip(sequences, before, after):
        tune_lp = torchtune_logprobs(model, ids)
        torch.testing.assert_close(new_lp, tune_lp, rtol=0, atol=1e-3)
        assert (old_lp - new_lp).abs().max() > 0.05  # the update changed the engine

    # Restore the engine for the other tests of the module.
    original = models.load_hf_state_dict(model_dir)
    llm.collective_rpc(_reload_weights_in_worker, args=(list(original.items()),))
    llm.reset_prefix_cache()


@pytest.mark.slow
def test_saved_checkpoint_loads_in_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = models.build_model(tiny_model_dir).eval()
    model.load_state_dict(perturbed_state_dict(model, seed=6))
    out = models.save_hf_checkpoint(model.state_dict(), tiny_model_dir, tmp_path / "step_6")
    llm = make_llm(out)
    try:
        sequences = random_sequences(models.load_hf_config(out)["vocab_size"])
        for ids, vllm_lp in zip(sequences, vllm_prompt_logprobs(llm, sequences)):
            torch.testing.assert_close(vllm_lp, torchtune_logprobs(model, ids), rtol=0, atol=1e-3)
    finally:
        del llm
        gc.collect()


@pytest.mark.slow
def test_bf16_probe_tolerance_passes_kernel_rounding_and_fails_other_weights(tmp_path: Path):
    """The weight probe in bf16: torchtune (the trainer) against vLLM's CPU kernels.

    The demo model with its logits made 3x larger (as training sharpens them) rounds some
    tokens' logprobs apart by over half a nat between the two. Every probe-like sequence must
    pass `probe_tolerance`'s bound; the logprobs of the model before that change must not.
    """
    import shutil

    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from grpo.packing.logprobs import model_response_logprobs
    from grpo.packing.packs import pack_sequences
    from grpo.weights.checksum import WeightSyncError
    from grpo.weights.verify import (
        check_probe,
        probe_sequence,
        probe_token_ids,
        probe_tolerance,
    )

    demo = Path(__file__).resolve().parents[2] / "assets" / "tiny_arithmetic_qwen2"
    sharp = tmp_path / "sharp"
    shutil.copytree(demo, sharp)
    weights = load_file(sharp / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 3
    save_file(weights, sharp / "model.safetensors", metadata={"format": "pt"})

    vocab_size = models.load_hf_config(demo)["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    sequences = [probe_token_ids(vocab_size)] + [
        torch.randint(0, vocab_size, (16,), generator=generator).tolist() for _ in range(24)
    ]

    def trainer_probes(model_dir: Path) -> list[list[float]]:
        model = models.build_model(model_dir, dtype=torch.bfloat16).eval()
        probes = []
        for ids in sequences:
            with torch.no_grad():
                logprobs = model_response_logprobs(
                    model, pack_sequences([probe_sequence(ids)], "cpu", 0)
                )
            probes.append(logprobs.float().tolist())
        return probes

    set_vllm_cpu_env()
    llm = LLM(
        model=str(sharp), **{**tiny_vllm_engine_kwargs(max_model_len=64), "dtype": "bfloat16"}
    )
    engine = vllm_prompt_logprobs(llm, sequences)
    del llm
    gc.collect()
    tolerance = probe_tolerance(torch.bfloat16)._asdict()
    sharp_probes, demo_probes = trainer_probes(sharp), trainer_probes(demo)
    largest = max(float((torch.tensor(p) - e).abs().max()) for p, e in zip(sharp_probes, engine))
    assert largest > 0.25  # kernel rounding alone moves a token this far
    for ids, sent, got in zip(sequences, sharp_probes, engine):
        check_probe(got.tolist(), {"token_ids": ids, "logprobs": sent, **tolerance}, version=1)
    for ids, sent, got in zip(sequences, demo_probes, engine):
        with pytest.raises(WeightSyncError, match="version 2"):
            check_probe(got.tolist(), {"token_ids": ids, "logprobs": sent, **tolerance}, version=2)
