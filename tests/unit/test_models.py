"""Tiny Qwen2 builder, torchtune model/tokenizer loading, weight names and HF checkpoints.

The slow tests at the end run a real vLLM CPU engine on the tiny checkpoints: they prove that
the files load in vLLM and that the weight conversion is right (torchtune and vLLM compute the
same logprobs).

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_models.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn
from torchtune.modules import TiedLinear

from grpo import models
from grpo.testing import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOKENIZER_FILES,
    build_tiny_qwen2,
)

TEXTS = [
    "What is 37 + 48?",
    "<think>\n37 + 48 = 85\n</think>\n<answer>85</answer>",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "Café, naïve, 日本語, 🙂 and “quotes” — ünïcödé",
    "e\u0301 is NFC-normalised to \u00e9",
    "  leading spaces,\ttabs\n\n\nand newlines   ",
    "12345678901234567890",
    "don't, I'LL, we've; they'd",
    "",
]


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
    }


def perturbed_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


# ------------------------------------------------------------------------------------------
# The builder
# ------------------------------------------------------------------------------------------


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_qwen2(tmp_path / "again")
    assert file_hashes(again) == file_hashes(tiny_model_dir)
    other_seed = file_hashes(build_tiny_qwen2(tmp_path / "seed1", seed=1))
    # The seed moves the weights only; the tokenizer is trained on a fixed corpus.
    assert other_seed["model.safetensors"] != file_hashes(tiny_model_dir)["model.safetensors"]
    for name in TOKENIZER_FILES:
        assert other_seed[name] == file_hashes(tiny_model_dir)[name]


def test_built_folder_has_hf_qwen2_layout(tiny_model_dir: Path) -> None:
    names = {path.name for path in tiny_model_dir.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES}
    config = models.load_hf_config(tiny_model_dir)
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU attention
    assert config["tie_word_embeddings"] is True

    added = json.loads((tiny_model_dir / "tokenizer.json").read_text())["added_tokens"]
    special_ids = {token["content"]: token["id"] for token in added}
    vocab = json.loads((tiny_model_dir / "vocab.json").read_text())
    # Special tokens follow the BPE vocabulary, as in Qwen2, and fit in the embedding.
    assert sorted(special_ids.values()) == [len(vocab), len(vocab) + 1, len(vocab) + 2]
    assert len(vocab) + 3 <= config["vocab_size"]
    assert config["eos_token_id"] == special_ids[IM_END]
    generation_config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [special_ids[IM_END], special_ids[ENDOFTEXT]]

    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in keys  # tied: HF stores no output projection
    assert len(keys) == 2 + 12 * config["num_hidden_layers"]


def test_build_tiny_qwen2_rejects_small_head_dim(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head dim"):
        build_tiny_qwen2(tmp_path / "bad", embed_dim=128, num_heads=8)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_qwen2(tmp_path / "bad", vocab_size=200)
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------
# torchtune model loading
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_build_model_matches_full_model_hf_checkpointer(
    tied: bool, tiny_model_dir: Path, tiny_untied_model_dir: Path, tmp_path: Path
) -> None:
    from torchtune.training import FullModelHFCheckpointer

    model_dir = tiny_model_dir if tied else tiny_untied_model_dir
    model = models.build_model(model_dir)
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(tmp_path / "checkpointer_out"),
    )
    checkpoint_state = checkpointer.load_checkpoint()["model"]
    model_state = model.state_dict()
    assert model_state.keys() == checkpoint_state.keys()
    for name, tensor in checkpoint_state.items():
        assert torch.equal(model_state[name], tensor), name

    hf_state = models.load_hf_state_dict(model_dir)
    assert torch.equal(model.tok_embeddings.weight, hf_state["model.embed_tokens.weight"])
    if tied:
        assert isinstance(model.output, TiedLinear)
        assert "output.weight" not in model_state
    else:
        assert isinstance(model.output, nn.Linear)
        assert torch.equal(model.output.weight, hf_state["lm_head.weight"])


def test_build_model_derives_architecture_from_config(tmp_path: Path) -> None:
    model_dir = build_tiny_qwen2(
        tmp_path / "wider",
        num_layers=3,
        embed_dim=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_dim=320,
        vocab_size=600,
        max_seq_len=512,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
    )
    model = models.build_model(model_dir)
    assert len(model.layers) == 3
    assert model.tok_embeddings.weight.shape == (600, 256)
    assert model.layers[0].attn.k_proj.weight.shape == (2 * 64, 256)
    assert model.layers[0].mlp.w1.weight.shape == (320, 256)
    assert model.max_seq_len == 512
    assert model.layers[0].attn.pos_embeddings.base == 10_000.0
    config = models.load_hf_config(model_dir)
    hf_names = {name for name, _ in models.hf_weight_iterator(model.state_dict(), config)}
    assert hf_names == set(models.load_hf_state_dict(model_dir))


def test_build_model_dtype_device_and_no_weights(tiny_model_dir: Path) -> None:
    model = models.build_model(tiny_model_dir, dtype=torch.bfloat16, max_seq_len=256)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.max_seq_len == 256
    hf_state = models.load_hf_state_dict(tiny_model_dir)
    expected = hf_state["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(model.tok_embeddings.weight, expected)

    fresh = models.build_model(tiny_model_dir, load_weights=False)
    assert not torch.equal(fresh.tok_embeddings.weight, hf_state["model.embed_tokens.weight"])
    meta = models.build_model(tiny_model_dir, device="meta", load_weights=False)
    assert meta.tok_embeddings.weight.is_meta
    with pytest.raises(ValueError, match="meta"):
        models.build_model(tiny_model_dir, device="meta")


def test_unsupported_config_is_rejected(tiny_model_dir: Path) -> None:
    config = models.load_hf_config(tiny_model_dir)
    with pytest.raises(ValueError, match="model_type"):
        models.qwen2_builder_args({**config, "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_scaling"):
        models.qwen2_builder_args({**config, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="head_dim"):
        models.qwen2_builder_args({**config, "head_dim": 32})
    missing = {key: value for key, value in config.items() if key != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        models.qwen2_builder_args(missing)
    # transformers 5 nests rope_theta in rope_parameters.
    nested = {key: value for key, value in config.items() if key != "rope_theta"}
    nested["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    assert models.qwen2_builder_args(nested)["rope_base"] == 5000.0


# ------------------------------------------------------------------------------------------
# Weight names
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tune_hf_round_trip_is_exact(
    tied: bool, tiny_model_dir: Path, tiny_untied_model_dir: Path
) -> None:
    model_dir = tiny_model_dir if tied else tiny_untied_model_dir
    config = models.load_hf_config(model_dir)
    tune_state = models.build_model(model_dir).state_dict()

    hf_state = models.tune_to_hf_state_dict(tune_state, config)
    stored = models.load_hf_state_dict(model_dir)
    # The names are exactly those of the checkpoint, and so are the values.
    assert hf_state.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(hf_state[name], tensor), name
    assert ("lm_head.weight" in hf_state) is not tied

    back = models.hf_to_tune_state_dict(hf_state, config)
    assert back.keys() == tune_state.keys()
    for name, tensor in tune_state.items():
        assert back[name] is tensor  # renaming only: no copies


def test_hf_weight_iterator_is_lazy_and_names_unknown_keys(tiny_model_dir: Path) -> None:
    config = models.load_hf_config(tiny_model_dir)
    tune_state = models.build_model(tiny_model_dir).state_dict()
    pairs = models.hf_weight_iterator(iter(tune_state.items()), config)
    assert next(pairs)[0] == "model.embed_tokens.weight"
    # A tied model's stray output.weight is dropped: HF and vLLM read it from the embedding.
    assert list(models.hf_weight_iterator({"output.weight": torch.zeros(1)}, config)) == []
    with pytest.raises(ValueError, match="layers.0.attn.bogus.weight"):
        list(models.hf_weight_iterator({"layers.0.attn.bogus.weight": torch.zeros(1)}, config))
    with pytest.raises(ValueError, match="model.bogus"):
        models.hf_to_tune_state_dict({"model.bogus": torch.zeros(1)}, config)


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers_of(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return (
        models.load_tokenizer(tiny_model_dir),
        AutoTokenizer.from_pretrained(str(tiny_model_dir)),
        Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")),
    )


def test_tokenizer_special_ids(tokenizers_of) -> None:
    tokenizer, hf_tok, _ = tokenizers_of
    special = {
        token: hf_tok.convert_tokens_to_ids(token) for token in (ENDOFTEXT, IM_START, IM_END)
    }
    assert tokenizer.eos_id == special[IM_END] == hf_tok.eos_token_id
    assert tokenizer.pad_id == special[ENDOFTEXT] == hf_tok.pad_token_id
    assert tokenizer.bos_id is None  # Qwen has no bos: add_bos changes nothing
    # generation_config.json's eos ids, in its order: what vLLM stops on.
    assert tokenizer.stop_tokens == [special[IM_END], special[ENDOFTEXT]]
    assert tokenizer.encode("hi", add_bos=True, add_eos=False) == tokenizer.encode(
        "hi", add_bos=False, add_eos=False
    )
    assert tokenizer.encode("hi", add_bos=False, add_eos=True)[-1] == tokenizer.eos_id
    assert tokenizer.encode(f"{IM_START}user", add_eos=False)[0] == special[IM_START]


def test_tokenizer_pickles_by_path(tokenizers_of) -> None:
    tokenizer = tokenizers_of[0]
    state = pickle.dumps(tokenizer)
    assert len(state) < 1_000  # the path, not the vocabulary
    copy = pickle.loads(state)
    assert copy.encode("What is 12 + 7?") == tokenizer.encode("What is 12 + 7?")
    assert copy.stop_tokens == tokenizer.stop_tokens


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizers_agree(text: str, tokenizers_of) -> None:
    tokenizer, hf_tok, raw_tok = tokenizers_of
    ids = tokenizer.encode(text, add_bos=False, add_eos=False)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids == raw_tok.encode(text, add_special_tokens=False).ids
    assert None not in ids  # every byte is in the vocabulary
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_digits_are_single_tokens(tokenizers_of) -> None:
    tokenizer, _, _ = tokenizers_of
    ids = tokenizer.encode("9876543210", add_bos=False, add_eos=False)
    assert [tokenizer.decode([i]) for i in ids] == list("9876543210")
    # Words of the corpus were merged: the tokenizer is not just bytes.
    assert len(tokenizer.encode("What is the answer", add_bos=False, add_eos=False)) <= 4


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet="abcdeWXYZ0123456789 +-*/=?.,'\n\t<>/éü日🙂", max_size=12),
            st.sampled_from(
                [ENDOFTEXT, IM_START, IM_END, "<think>", "</answer>", " 42", "e\u0301"]
            ),
        ),
        max_size=8,
    ).map("".join)
)
def test_tokenizers_agree_on_random_text(tokenizers_of, text: str) -> None:
    tokenizer, hf_tok, _ = tokenizers_of
    assert tokenizer.encode(text, add_bos=False, add_eos=False) == hf_tok.encode(
        text, add_special_tokens=False
    )


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


def test_missing_model_folder_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    for load in (models.load_hf_config, models.build_model, models.load_tokenizer):
        with pytest.raises(FileNotFoundError, match="no_such_model"):
            load(missing)


@pytest.mark.parametrize("removed", ["tokenizer.json", "config.json", "model.safetensors"])
def test_missing_file_names_the_path(removed: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model_dir / removed).unlink()
    load = models.load_tokenizer if removed == "tokenizer.json" else models.build_model
    with pytest.raises(FileNotFoundError) as info:
        load(model_dir)
    assert str(model_dir) in str(info.value)
    assert removed in str(info.value)


def test_tokenizer_without_eos_is_rejected(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = None
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="no eos token.*tokenizer_config.json"):
        models.load_tokenizer(model_dir)


def test_chat_template_renders_and_its_absence_is_named(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = models.load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == (
        f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\n1+1?{IM_END}\n{IM_START}assistant\n"
    )
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="has no chat template") as info:
        models.load_tokenizer(model_dir).apply_chat_template(messages)
    assert str(model_dir) in str(info.value)


def test_bad_config_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        models.load_hf_config(model_dir)


# ------------------------------------------------------------------------------------------
# Saving checkpoints
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_save_hf_checkpoint_loads_back_identically(
    tied: bool, tiny_model_dir: Path, tiny_untied_model_dir: Path, tmp_path: Path
) -> None:
    src = tiny_model_dir if tied else tiny_untied_model_dir
    new_state = perturbed_state_dict(models.build_model(src), seed=1)
    out = models.save_hf_checkpoint(new_state, src, tmp_path / "step_1")

    reloaded = models.build_model(out).state_dict()
    assert reloaded.keys() == new_state.keys()
    for name, tensor in new_state.items():
        assert torch.equal(reloaded[name], tensor), name
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert models.load_hf_config(out) == models.load_hf_config(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # no temp dirs left


def test_save_hf_checkpoint_bf16_and_sharded(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = models.build_model(tiny_model_dir, dtype=torch.bfloat16)
    out = models.save_hf_checkpoint(
        model.state_dict(), tiny_model_dir, tmp_path / "sharded", max_shard_bytes=100_000
    )
    config = models.load_hf_config(out)
    assert config["torch_dtype"] == "bfloat16"
    index = json.loads((out / models.SAFETENSORS_INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / models.SAFETENSORS_FILE).exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards

    reloaded = models.build_model(out, dtype=torch.bfloat16).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def test_save_hf_checkpoint_rejects_partial_state_dict(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    state = models.build_model(tiny_model_dir).state_dict()
    del state["layers.1.mlp.w2.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        models.save_hf_checkpoint(state, tiny_model_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [True, False])
def test_save_hf_checkpoint_is_atomic_on_write_failure(
    existing: bool, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "latest"
    state = models.build_model(tiny_model_dir).state_dict()
    if existing:
        models.save_hf_checkpoint(state, tiny_model_dir, out)
    before = file_hashes(out) if existing else None

    def failing_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a safetensors file")
        raise OSError("disk full")

    monkeypatch.setattr(models.save, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        models.save_hf_checkpoint(
            perturbed_state_dict(models.build_model(tiny_model_dir), 2), tiny_model_dir, out
        )

    assert sorted(p.name for p in tmp_path.iterdir()) == (["latest"] if existing else [])
    if existing:
        assert file_hashes(out) == before


def test_save_hf_checkpoint_restores_old_folder_if_swap_fails(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "latest"
    state = models.build_model(tiny_model_dir).state_dict()
    models.save_hf_checkpoint(state, tiny_model_dir, out)
    before = file_hashes(out)
    real_rename = os.rename

    def rename_failing_on_publish(src, dst):
        if Path(dst) == out:  # the new folder taking the name, not the old one moving away
            if ".tmp-" in Path(src).name:
                raise OSError("rename failed")
        return real_rename(src, dst)

    monkeypatch.setattr(models.save.os, "rename", rename_failing_on_publish)
    with pytest.raises(OSError, match="rename failed"):
        models.save_hf_checkpoint(
            perturbed_state_dict(models.build_model(tiny_model_dir), 3), tiny_model_dir, out
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert file_hashes(out) == before


def test_save_hf_checkpoint_replaces_existing_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "latest"
    model = models.build_model(tiny_model_dir)
    models.save_hf_checkpoint(model.state_dict(), tiny_model_dir, out)
    (out / "stale_file.txt").write_text("from the previous checkpoint")
    new_state = perturbed_state_dict(model, seed=4)
    models.save_hf_checkpoint(new_state, tiny_model_dir, out)
    assert not (out / "stale_file.txt").exists()
    assert torch.equal(
        models.build_model(out).tok_embeddings.weight, new_state["tok_embeddings.weight"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
