"""The model families Qwen2, Qwen3 and Llama 3 on tiny checkpoints built on the fly.

Each family is checked the same ways: our torchtune model's logits equal transformers' on the
same folder (the proof that q/k norms, head_dim, RoPE scaling and q/k permutations are right),
the HF <-> torchtune conversion and a saved checkpoint round-trip exactly, packed logprobs
equal those of each sequence alone, and (slow) a vLLM CPU engine loads the folder, decodes
like our model and takes an in-place weight update that passes the checksum and a logprob
probe. Two end-to-end ``grpo run``s (slow) train a tiny Qwen3 and a tiny Llama.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_model_families.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn
from torchtune.modules import MultiHeadAttention

from grpo import models
from grpo.packing.attention import use_packed_attention
from grpo.packing.packs import (
    pack_sequences,
    packed_forward_inputs,
    unpack_response_logprobs,
)
from grpo.testing import (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    EOT_ID,
    IM_END,
    LLAMA3_SPECIAL_TOKENS,
    TOKENIZER_FILES,
    build_tiny_llama,
    build_tiny_qwen2,
    build_tiny_qwen3,
)
from grpo.testing.packing import logprobs_from_logits
from grpo.types import UnscoredTrajectory

FAMILIES = ("qwen2", "qwen3", "llama")
BUILDERS: dict[str, Callable[..., Path]] = {
    "qwen2": build_tiny_qwen2,
    "qwen3": build_tiny_qwen3,
    "llama": build_tiny_llama,
}
# Variants that take the other torchtune code paths: untied outputs, and Llama 3.0's plain
# RoPE (torchtune's llama3 builder) beside 3.1's (llama3_1) and 3.2's tied one (llama3_2).
VARIANTS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "llama": ("llama", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-3.0": ("llama", {"tie_word_embeddings": False, "rope_scaling": None}),
}
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family, default arguments (read-only: copy before changing)."""
    root = tmp_path_factory.mktemp("families")
    return {family: BUILDERS[family](root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory: pytest.TempPathFactory, family_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {
        name: family_dirs[family] if not kwargs else BUILDERS[family](root / name, **kwargs)
        for name, (family, kwargs) in VARIANTS.items()
    }


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def random_tokens(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (batch, length), generator=generator)


def sequence_logprobs(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Logprob of token t given tokens < t, for t = 1..len-1 (fp32)."""
    tokens = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(tokens)[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]


def perturbed_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf_model(tokens).logits


# ------------------------------------------------------------------------------------------
# The tiny checkpoints
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_rebuild_is_byte_identical(family: str, family_dirs, tmp_path: Path) -> None:
    again = BUILDERS[family](tmp_path / "again")
    assert file_hashes(again) == file_hashes(family_dirs[family])
    other_seed = file_hashes(BUILDERS[family](tmp_path / "seed1", seed=1))
    assert other_seed["model.safetensors"] != file_hashes(again)["model.safetensors"]
    for name in TOKENIZER_FILES:
        assert other_seed[name] == file_hashes(again)[name]


def test_tiny_qwen3_has_the_qwen3_layout(family_dirs) -> None:
    model_dir = family_dirs["qwen3"]
    config = models.load_hf_config(model_dir)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    # An explicit head_dim different from hidden_size // num_attention_heads, as in Qwen3.
    assert config["head_dim"] == 64 != config["hidden_size"] // config["num_attention_heads"]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor("model.layers.0.self_attn.q_norm.weight").shape == (64,)
    assert not any(key.endswith(".bias") for key in keys)
    assert "lm_head.weight" not in keys
    # Qwen2's tokenizer files, byte for byte.
    for name in TOKENIZER_FILES:
        qwen2_file = family_dirs["qwen2"] / name
        assert (model_dir / name).read_bytes() == qwen2_file.read_bytes(), name


def test_tiny_llama_has_llama3_tokenizer_and_config(family_dirs) -> None:
    from transformers import AutoTokenizer

    model_dir = family_dirs["llama"]
    config = models.load_hf_config(model_dir)
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["rope_scaling"]["rope_type"] == "llama3"
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = {token: raw.token_to_id(token) for token in LLAMA3_SPECIAL_TOKENS}
    vocab = json.loads((model_dir / "vocab.json").read_text())
    assert sorted(ids.values()) == list(range(len(vocab), len(vocab) + 5))
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [ids[END_OF_TEXT], ids[EOT_ID]]

    # The post-processor adds the bos, as Llama 3's does, in tokenizers and in transformers.
    text = "What is 123 + 4567?"
    plain = raw.encode(text, add_special_tokens=False).ids
    assert raw.encode(text).ids == [ids[BEGIN_OF_TEXT], *plain]
    hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert hf_tok.encode(text) == [ids[BEGIN_OF_TEXT], *plain]
    assert hf_tok.eos_token_id == ids[EOT_ID] and hf_tok.bos_token_id == ids[BEGIN_OF_TEXT]
    assert hf_tok.decode(plain) == text
    # Llama 3's number split: runs of up to three digits.
    assert [piece for piece, _ in raw.pre_tokenizer.pre_tokenize_str("1234567")] == [
        "123",
        "456",
        "7",
    ]
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi there "}], tokenize=False, add_generation_prompt=True
    )
    assert chat == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_load_tokenizer_reads_each_familys_special_tokens(family: str, family_dirs) -> None:
    model_dir = family_dirs[family]
    tokenizer = models.load_tokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "What is 37 + 48?"
    plain = raw.encode(text, add_special_tokens=False).ids
    if family == "llama":
        assert tokenizer.eos_id == raw.token_to_id(EOT_ID)
        assert tokenizer.stop_tokens == [raw.token_to_id(END_OF_TEXT), raw.token_to_id(EOT_ID)]
        assert tokenizer.encode(text, add_eos=False) == [raw.token_to_id(BEGIN_OF_TEXT), *plain]
    else:  # Qwen2 and Qwen3: no bos, ChatML eos
        assert tokenizer.eos_id == raw.token_to_id(IM_END)
        assert tokenizer.encode(text, add_eos=False) == plain
    assert tokenizer.decode(plain) == text


def test_tiny_builders_reject_unusable_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head dim 32"):
        build_tiny_qwen3(tmp_path / "bad", head_dim=32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_qwen3(tmp_path / "bad", num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_llama(tmp_path / "bad", vocab_size=260)
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------
# Our torchtune model computes what transformers computes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(variant: str, variant_dirs) -> None:
    model_dir = variant_dirs[variant]
    model = models.build_model(model_dir).eval()
    # Two rows and 300 positions: beyond the tiny Llama's original context (64) of its
    # scaled RoPE, so every frequency band of the scaling is used.
    tokens = random_tokens(300, batch=2)
    with torch.no_grad():
        ours = model(tokens)
    expected = hf_logits(model_dir, tokens)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.5  # logits vary, so agreement is not trivial


def test_qwen3_norms_before_rope_matter(family_dirs) -> None:
    """Negative control: torchtune's stock order (q/k norm after RoPE) gives other logits."""
    model = models.build_model(family_dirs["qwen3"]).eval()
    tokens = random_tokens(64)
    for layer in model.layers:
        # torchtune 0.6.1's own forward: the same modules, norms applied after RoPE.
        layer.attn.forward = MultiHeadAttention.forward.__get__(layer.attn)
    with torch.no_grad():
        stock = model(tokens)
    assert (stock - hf_logits(family_dirs["qwen3"], tokens)).abs().max() > 0.1


def test_llama_rope_scaling_matters(family_dirs, tmp_path: Path) -> None:
    """Negative control: the same weights without the config's RoPE scaling differ."""
    model_dir = Path(shutil.copytree(family_dirs["llama"], tmp_path / "unscaled"))
    config = models.load_hf_config(model_dir)
    args = models.llama_builder_args(config)["rope_scaling"]
    assert args == {
        "scale_factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "old_context_len": 64.0,
    }
    rope = models.build_model(family_dirs["llama"]).layers[0].attn.pos_embeddings
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.old_context_len) == (1, 4, 64)
    (model_dir / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    tokens = random_tokens(64)
    with torch.no_grad():
        unscaled = models.build_model(model_dir).eval()(tokens)
    assert (unscaled - hf_logits(family_dirs["llama"], tokens)).abs().max() > 0.1


# ------------------------------------------------------------------------------------------
# Weight conversion and checkpoints
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "qwen3-untied", "llama", "llama-untied"])
def test_hf_tune_round_trip_is_exact(variant: str, variant_dirs) -> None:
    model_dir = variant_dirs[variant]
    config = models.load_hf_config(model_dir)
    tune_state = models.build_model(model_dir).state_dict()
    stored = models.load_hf_state_dict(model_dir)
    hf_state = models.tune_to_hf_state_dict(tune_state, config)
    assert hf_state.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(hf_state[name], tensor), name
    back = models.hf_to_tune_state_dict(hf_state, config)
    assert back.keys() == tune_state.keys()
    for name, tensor in tune_state.items():
        assert torch.equal(back[name], tensor), name
    # The lazy iterator yields the same pairs, in the state dict's order.
    pairs = list(models.hf_weight_iterator(iter(tune_state.items()), config))
    assert [name for name, _ in pairs] == list(hf_state)


def test_llama_q_k_are_permuted_and_the_rest_renamed(family_dirs) -> None:
    model_dir = family_dirs["llama"]
    stored = models.load_hf_state_dict(model_dir)
    tune_state = models.build_model(model_dir).state_dict()
    hf_q = stored["model.layers.0.self_attn.q_proj.weight"]
    tune_q = tune_state["layers.0.attn.q_proj.weight"]
    assert not torch.equal(hf_q, tune_q)  # rows reordered for torchtune's interleaved RoPE
    assert torch.equal(hf_q.sort(dim=0).values, tune_q.sort(dim=0).values)
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(stored[v], tune_state["layers.0.attn.v_proj.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_checkpoint_loads_back_identically(family: str, family_dirs, tmp_path) -> None:
    src = family_dirs[family]
    new_state = perturbed_state_dict(models.build_model(src), seed=1)
    out = models.save_hf_checkpoint(new_state, src, tmp_path / "step_1")
    reloaded = models.build_model(out).state_dict()
    assert reloaded.keys() == new_state.keys()
    for name, tensor in new_state.items():
        assert torch.equal(reloaded[name], tensor), name
    assert models.load_hf_config(out) == models.load_hf_config(src)
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes()


# ------------------------------------------------------------------------------------------
# Packed sequences
# ------------------------------------------------------------------------------------------


def trajectory(index: int, prompt_len: int, response_len: int) -> UnscoredTrajectory:
    generator = torch.Generator().manual_seed(index)
    return UnscoredTrajectory(
        prompt_tokens=torch.randint(1, VOCAB_SIZE, (prompt_len,), generator=generator),
        response_tokens=torch.randint(1, VOCAB_SIZE, (response_len,), generator=generator),
        prompt_len=prompt_len,
        response_len=response_len,
        logprobs=torch.zeros(response_len),
        answer="42",
        sequence_id=f"seq-{index}",
        policy_version=0,
        group_id=index,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logprobs_equal_alone(family: str, family_dirs) -> None:
    model = use_packed_attention(models.build_model(family_dirs[family]).eval())
    shapes = [(7, 1), (90, 5), (1, 9), (40, 60), (15, 33)]
    sequences = [trajectory(i, p, r) for i, (p, r) in enumerate(shapes)]
    with torch.no_grad():
        alone = []
        for seq in sequences:
            ids = torch.cat([seq.prompt_tokens, seq.response_tokens]).tolist()
            alone.append(sequence_logprobs(model, ids)[seq.prompt_len - 1 :])
        for mask_kind in ("dense", "varlen"):
            packed = pack_sequences(
                sequences, "cpu", 0, target_tokens_per_batch=320, mask_kind=mask_kind
            )
            logits = model(**packed_forward_inputs(packed))
            pieces = unpack_response_logprobs(packed, logprobs_from_logits(logits, packed))
            for seq, expected, got in zip(sequences, alone, pieces):
                diff = (got - expected).abs().max().item()
                assert diff <= 1e-5, f"{family}/{mask_kind}: {seq.sequence_id} off by {diff}"
    assert torch.cat(alone).std() > 0.5


# ------------------------------------------------------------------------------------------
# Configs a family cannot build
# ------------------------------------------------------------------------------------------


def test_unsupported_features_are_named(family_dirs) -> None:
    qwen3 = models.load_hf_config(family_dirs["qwen3"])
    llama = models.load_hf_config(family_dirs["llama"])
    cases = [
        (models.qwen3_builder_args, {**qwen3, "model_type": "qwen2"}, "model_type"),
        (models.qwen3_builder_args, {**qwen3, "attention_bias": True}, "attention_bias"),
        (models.qwen3_builder_args, {**qwen3, "use_sliding_window": True}, "sliding_window"),
        (
            models.qwen3_builder_args,
            {**qwen3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "RoPE scaling",
        ),
        (models.llama_builder_args, {**llama, "mlp_bias": True}, "mlp_bias"),
        (models.llama_builder_args, {**llama, "head_dim": 32}, "head_dim"),
        (
            models.llama_builder_args,
            {**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "'yarn'",
        ),
        (
            models.llama_builder_args,
            {**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor",
        ),
        (
            models.llama_builder_args,
            {k: v for k, v in llama.items() if k != "num_hidden_layers"},
            "num_hidden_layers",
        ),
    ]
    for builder_args, config, message in cases:
        with pytest.raises(ValueError, match=message):
            builder_args(config)
    # transformers 5 spells the scaling and the base as rope_parameters.
    nested = {k: v for k, v in llama.items() if k not in ("rope_scaling", "rope_theta")}
    nested["rope_parameters"] = {**llama["rope_scaling"], "rope_theta": 5000.0}
    args = models.llama_builder_args(nested)
    assert args["rope_base"] == 5000.0 and args["rope_scaling"]["scale_factor"] == 8.0


def test_unsupported_model_type_names_type_file_and_supported(family_dirs, tmp_path) -> None:
    assert models.SUPPORTED_MODEL_TYPES == ("qwen2", "qwen3", "llama")
    model_dir = Path(shutil.copytree(family_dirs["llama"], tmp_path / "model"))
    config = models.load_hf_config(model_dir)
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError) as info:
        models.build_model(model_dir)
    message = str(info.value)
    assert "'mistral'" in message and str(model_dir / "config.json") in message
    assert all(name in message for name in models.SUPPORTED_MODEL_TYPES)
    for convert in (models.hf_to_tune_state_dict, models.tune_to_hf_state_dict):
        with pytest.raises(ValueError, match="mistral"):
            convert({}, {**config, "model_type": "mistral"})
    with pytest.raises(ValueError, match="mistral"):
        models.hf_weight_iterator({}, {**config, "model_type": "mistral"})


def test_unknown_weight_names_are_named(family_dirs) -> None:
    for family in ("qwen3", "llama"):
        config = models.load_hf_config(family_dirs[family])
        with pytest.raises(ValueError, match="layers.0.attn.bogus.weight"):
            list(models.hf_weight_iterator({"layers.0.attn.bogus.weight": torch.zeros(1)}, config))
        with pytest.raises(ValueError, match="model.bogus"):
            models.hf_to_tune_state_dict({"model.bogus": torch.zeros(1)}, config)
