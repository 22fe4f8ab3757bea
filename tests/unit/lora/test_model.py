"""LoRA adapters on the tiny Qwen2, Qwen3 and Llama models (`grpo.models.lora`).

A fresh adapter changes no logit, a trained one does, and switched off (torchtune's
``disable_adapter``) the model is the base model again; only the adapters train. The PEFT
names round-trip and mean what PEFT means (``W + scale * B @ A`` in HF layout, Llama's q/k rows
included), and a merged state dict loads into a plain model with the same logits. That vLLM
serves the PEFT folder with our model's logprobs: tests/integration/lora/test_serving.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torchtune.modules.peft import LoRALinear, disable_adapter

from grpo import models
from grpo.config import LoRAConfig
from grpo.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LORA_MODULES,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
    is_adapter_key,
    load_peft_adapter,
    lora_modules,
    merge_lora,
    merge_peft_adapter,
    peft_adapter_config,
    peft_adapter_state_dict,
    reset_lora_parameters,
    save_peft_adapter,
    trainable_parameters,
    tune_adapter_state_dict,
)
from grpo.testing import build_tiny_llama, build_tiny_qwen2, build_tiny_qwen3

FAMILIES = ("qwen2", "qwen3", "llama")
BUILDERS = {"qwen2": build_tiny_qwen2, "qwen3": build_tiny_qwen3, "llama": build_tiny_llama}
ALL_TARGETS = list(LORA_MODULES)
CONFIG = LoRAConfig(rank=8, alpha=16.0, target_modules=ALL_TARGETS)
NUM_LAYERS = 2  # the tiny models'


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family (read-only)."""
    root = tmp_path_factory.mktemp("lora_families")
    return {family: BUILDERS[family](root / family) for family in FAMILIES}


def tokens(length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, length), generator=torch.Generator().manual_seed(seed))


def lora_model(model_dir: Path, config: LoRAConfig = CONFIG, seed: int = 0) -> nn.Module:
    model = models.build_model(model_dir)
    torch.manual_seed(seed)
    apply_lora(model, config)
    return model.eval()


def train_adapter(model: nn.Module, seed: int = 1) -> None:
    """Give every adapter a random B (a fresh one is zero), as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(model):
            weight = module.lora_b.weight
            weight.copy_(0.05 * torch.randn(weight.shape, generator=generator))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


# ------------------------------------------------------------------------------ apply_lora


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_modules_are_the_same_linear_layers_in_torchtune_and_hf(family, family_dirs):
    model = models.build_model(family_dirs[family], load_weights=False)
    hf_paths = {
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj",
        "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "down_proj": "mlp.down_proj",
    }
    hf_state = models.load_hf_state_dict(family_dirs[family])
    for target, path in LORA_MODULES.items():
        module = model.layers[0].get_submodule(path)
        assert type(module) is nn.Linear, (target, path)
        hf_weight = f"model.layers.0.{hf_paths[target]}.weight"
        assert hf_weight in hf_state
        # Same layer: same shape as the HF weight of that name.
        assert module.weight.shape == hf_state[hf_weight].shape, target


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_is_off_when_fresh_and_when_disabled(family, family_dirs):
    x = tokens()
    base = models.build_model(family_dirs[family]).eval()
    base_logits = logits(base, x)
    model = models.build_model(family_dirs[family])
    q_proj = model.layers[0].attn.q_proj
    apply_lora(model, CONFIG)
    model.eval()

    wrapped = lora_modules(model)
    assert len(wrapped) == NUM_LAYERS * len(ALL_TARGETS)
    assert all(isinstance(m, LoRALinear) and m.rank == 8 and m.alpha == 16.0 for _, m in wrapped)
    # The base Parameters are reused, not copied; Qwen2 keeps its q/k/v biases.
    assert model.layers[0].attn.q_proj.weight is q_proj.weight
    assert model.layers[0].attn.q_proj.bias is q_proj.bias
    assert (q_proj.bias is not None) == (family == "qwen2")

    assert torch.equal(logits(model, x), base_logits)  # lora_b is zero
    train_adapter(model)
    assert (logits(model, x) - base_logits).abs().max() > 1e-3
    with disable_adapter(model):
        assert torch.equal(logits(model, x), base_logits)
    assert (logits(model, x) - base_logits).abs().max() > 1e-3  # back on


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keeps_base_names_and_adds_adapter_keys(family, family_dirs):
    base_keys = set(models.build_model(family_dirs[family], load_weights=False).state_dict())
    state = lora_model(family_dirs[family]).state_dict()
    assert set(base_state_dict(state)) == base_keys
    adapter = adapter_state_dict(state)
    assert len(adapter) == 2 * NUM_LAYERS * len(ALL_TARGETS)
    assert "layers.0.attn.q_proj.lora_a.weight" in adapter
    assert "layers.1.mlp.w2.lora_b.weight" in adapter
    assert state["layers.0.attn.q_proj.lora_a.weight"].shape == (8, 128)
    assert all(t.dtype == torch.float32 for t in adapter.values())
    assert is_adapter_key("layers.0.attn.q_proj.lora_b.weight")
    assert not is_adapter_key("layers.0.attn.q_proj.weight")
    assert not is_adapter_key("layers.0.attn.lora_a_proj.weight")


def test_only_the_adapters_train(family_dirs):
    model = lora_model(family_dirs["qwen2"])
    model.train()
    trainable = trainable_parameters(model)
    adapter_ids = {id(p) for n, p in model.named_parameters() if is_adapter_key(n)}
    assert {id(p) for p in trainable} == adapter_ids
    assert len(trainable) == 2 * NUM_LAYERS * len(ALL_TARGETS)
    for name, param in model.named_parameters():
        assert param.requires_grad == is_adapter_key(name), name
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == adapter_ids

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(tokens()).logsumexp(-1).mean().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        assert (param.grad is None) == (not is_adapter_key(name)), name
        if not is_adapter_key(name):
            assert torch.equal(param, before[name]), name
        elif name.endswith("lora_b.weight"):  # lora_a's gradient is zero while lora_b is
            assert not torch.equal(param, before[name]), name


def test_same_seed_same_adapter_and_torchtune_init(family_dirs):
    first = adapter_state_dict(lora_model(family_dirs["qwen3"], seed=3).state_dict())
    second = adapter_state_dict(lora_model(family_dirs["qwen3"], seed=3).state_dict())
    other = adapter_state_dict(lora_model(family_dirs["qwen3"], seed=4).state_dict())
    assert all(torch.equal(first[n], second[n]) for n in first)
    name = "layers.0.attn.q_proj.lora_a.weight"
    assert not torch.equal(first[name], other[name])
    for n, t in first.items():
        if n.endswith("lora_b.weight"):
            assert not t.any(), n
        else:  # kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
            bound = 1 / t.shape[1] ** 0.5
            assert t.abs().max() <= bound and t.std() > bound / 4, n


def test_meta_model_then_reset_gives_the_same_adapter(family_dirs):
    model_dir = family_dirs["llama"]
    model = models.build_model(model_dir, device="meta", load_weights=False)
    apply_lora(model, CONFIG)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.load_state_dict(models.build_model(model_dir).state_dict(), strict=False)
    torch.manual_seed(5)
    reset_lora_parameters(model)
    expected = lora_model(model_dir, seed=5).state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[n], expected[n]) for n in expected)


def test_some_targets_and_bf16(family_dirs):
    model = models.build_model(family_dirs["qwen2"], dtype=torch.bfloat16)
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=["v_proj", "down_proj"])
    apply_lora(model, config)
    names = {name for name, _ in lora_modules(model)}
    assert names == {f"layers.{i}.{p}" for i in range(2) for p in ("attn.v_proj", "mlp.w2")}
    assert all(t.dtype == torch.bfloat16 for t in adapter_state_dict(model.state_dict()).values())
    with pytest.raises(ValueError, match="'v_proj' is layers.0.attn.v_proj, a LoRALinear"):
        apply_lora(model, config)


# ------------------------------------------------------------------------------ PEFT format


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_names_round_trip(family, family_dirs):
    hf_config = models.load_hf_config(family_dirs[family])
    model = lora_model(family_dirs[family])
    train_adapter(model)
    with torch.no_grad():  # a non-zero A too, so that no permutation hides in a zero
        for _, module in lora_modules(model):
            module.lora_a.weight.add_(0.01)
    adapter = adapter_state_dict(model.state_dict())
    peft = peft_adapter_state_dict(adapter, hf_config)
    prefix = "base_model.model.model.layers"
    assert f"{prefix}.0.self_attn.q_proj.lora_A.weight" in peft
    assert f"{prefix}.1.self_attn.o_proj.lora_B.weight" in peft
    assert f"{prefix}.1.mlp.gate_proj.lora_B.weight" in peft
    assert f"{prefix}.0.mlp.up_proj.lora_A.weight" in peft
    assert f"{prefix}.0.mlp.down_proj.lora_A.weight" in peft
    assert len(peft) == len(adapter)
    back = tune_adapter_state_dict(peft, hf_config)
    assert back.keys() == adapter.keys()
    assert all(torch.equal(back[n], adapter[n]) for n in adapter)
    permuted = not torch.equal(
        peft[f"{prefix}.0.self_attn.q_proj.lora_B.weight"],
        adapter["layers.0.attn.q_proj.lora_b.weight"],
    )
    assert permuted == (family == "llama")  # Llama's q/k rows are reordered as HF stores them


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_tensors_mean_w_plus_scale_b_a_in_hf_layout(family, family_dirs):
    hf_config = models.load_hf_config(family_dirs[family])
    model = lora_model(family_dirs[family])
    train_adapter(model)
    state = model.state_dict()
    peft = peft_adapter_state_dict(adapter_state_dict(state), hf_config)
    merged_hf = models.tune_to_hf_state_dict(merge_lora(state, CONFIG), hf_config)
    base_hf = models.load_hf_state_dict(family_dirs[family])
    scale = CONFIG.alpha / CONFIG.rank
    for target in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        module = f"model.layers.1.{target}"
        a = peft[f"base_model.model.{module}.lora_A.weight"]
        b = peft[f"base_model.model.{module}.lora_B.weight"]
        expected = base_hf[f"{module}.weight"] + scale * b @ a
        torch.testing.assert_close(merged_hf[f"{module}.weight"], expected, rtol=0, atol=1e-6)


def test_peft_names_refuse_other_tensors(family_dirs):
    hf_config = models.load_hf_config(family_dirs["qwen2"])
    with pytest.raises(ValueError, match="embed_tokens"):
        tune_adapter_state_dict(
            {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(1)}, hf_config
        )
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.weight"):
        peft_adapter_state_dict({"layers.0.attn.q_proj.weight": torch.zeros(1)}, hf_config)


def test_save_and_load_peft_adapter(family_dirs, tmp_path):
    model_dir = family_dirs["qwen2"]
    hf_config = models.load_hf_config(model_dir)
    peft = peft_adapter_state_dict(
        adapter_state_dict(lora_model(model_dir).state_dict()), hf_config
    )
    config = peft_adapter_config(CONFIG, model_dir)
    out = save_peft_adapter(tmp_path / "adapter", peft, config)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary left
    tensors, loaded = load_peft_adapter(out)
    assert tensors.keys() == peft.keys()
    assert all(torch.equal(tensors[n], peft[n]) for n in peft)
    assert loaded == json.loads(json.dumps(config))
    assert loaded["peft_type"] == "LORA" and loaded["task_type"] == "CAUSAL_LM"
    assert (loaded["r"], loaded["lora_alpha"], loaded["lora_dropout"]) == (8, 16.0, 0.0)
    assert loaded["target_modules"] == sorted(ALL_TARGETS)
    assert loaded["base_model_name_or_path"] == str(model_dir.resolve())
    assert loaded["bias"] == "none" and loaded["fan_in_fan_out"] is False
    # Saving again replaces the folder.
    save_peft_adapter(out, {n: t + 1 for n, t in peft.items()}, config)
    name = next(iter(peft))
    assert torch.equal(load_peft_adapter(out)[0][name], peft[name] + 1)
    with pytest.raises(FileNotFoundError, match="is not a PEFT adapter folder"):
        load_peft_adapter(tmp_path)


# ------------------------------------------------------------------------------ merge


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_state_loads_into_a_plain_model_with_the_same_logits(family, family_dirs):
    x = tokens(seed=2)
    model = lora_model(family_dirs[family])
    train_adapter(model)
    state = model.state_dict()
    merged = merge_lora(state, CONFIG)
    assert not any(is_adapter_key(n) for n in merged)
    assert merged["layers.0.attn.q_proj.weight"] is not state["layers.0.attn.q_proj.weight"]
    plain = models.build_model(family_dirs[family], load_weights=False).eval()
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(logits(plain, x), logits(model, x), rtol=0, atol=1e-5)
    # The input is untouched: the LoRA model's base weight is still the checkpoint's.
    base = models.build_model(family_dirs[family]).state_dict()
    assert torch.equal(state["layers.0.attn.q_proj.weight"], base["layers.0.attn.q_proj.weight"])


def test_merge_names_a_missing_half():
    state = {"layers.0.attn.q_proj.weight": torch.zeros(4, 4)}
    state["layers.0.attn.q_proj.lora_a.weight"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.lora_b.weight"):
        merge_lora(state, LoRAConfig(rank=2))


@pytest.mark.parametrize("family", FAMILIES)
def test_merging_the_peft_adapter_into_hf_weights_is_merge_lora_exactly(family, family_dirs):
    """What a collector serving ``merged`` loads: the HF weights with the adapter folded in,
    bit for bit torchtune's merge in HF names (Llama's permuted q/k rows included), computing
    the LoRA model's logits."""
    hf_config = models.load_hf_config(family_dirs[family])
    model = lora_model(family_dirs[family])
    train_adapter(model)
    state = model.state_dict()
    peft = peft_adapter_state_dict(adapter_state_dict(state), hf_config)
    base_hf = models.load_hf_state_dict(family_dirs[family])
    before = {name: t.clone() for name, t in base_hf.items()}
    merged = merge_peft_adapter(base_hf, peft, CONFIG.alpha / CONFIG.rank)
    expected = models.tune_to_hf_state_dict(merge_lora(state, CONFIG), hf_config)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)
    assert all(torch.equal(base_hf[name], before[name]) for name in before)  # untouched
    changed = {name for name in merged if not torch.equal(merged[name], base_hf[name])}
    assert len(changed) == len(ALL_TARGETS) * NUM_LAYERS
    plain = models.build_model(family_dirs[family], load_weights=False).eval()
    plain.load_state_dict(models.hf_to_tune_state_dict(merged, hf_config), strict=True)
    torch.testing.assert_close(logits(plain, tokens(seed=3)), logits(model, tokens(seed=3)))
    # A wrong scale is another model.
    assert not torch.equal(
        merge_peft_adapter(base_hf, peft, 1.0)["model.layers.0.self_attn.q_proj.weight"],
        merged["model.layers.0.self_attn.q_proj.weight"],
    )


def test_merging_a_peft_adapter_names_what_is_missing():
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    base = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}
    half = {f"{prefix}.lora_A.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match="q_proj'?: no lora_B"):
        merge_peft_adapter(base, half, 1.0)
    whole = {**half, f"{prefix}.lora_B.weight": torch.zeros(4, 2)}
    with pytest.raises(ValueError, match="no base weight"):
        merge_peft_adapter({}, whole, 1.0)
    with pytest.raises(ValueError, match="embed_tokens"):
        merge_peft_adapter(base, {"base_model.model.model.embed_tokens.lora_A.weight": 0}, 1.0)


# ------------------------------------------------------------------------------ serving


def test_auto_serves_merged_on_cpu_and_the_adapter_on_gpu(monkeypatch):
    from grpo.weights.adapter import serves_merged

    auto = LoRAConfig(rank=8)
    assert auto.serve == "auto"
    assert serves_merged(auto, on_cpu=True)
    assert not serves_merged(auto, on_cpu=False)
    for on_cpu in (True, False):  # a setting other than auto is kept wherever the engine runs
        assert serves_merged(LoRAConfig(rank=8, serve="merged"), on_cpu=on_cpu)
        assert not serves_merged(LoRAConfig(rank=8, serve="adapter"), on_cpu=on_cpu)
    # Unsaid, the engine's device is where CUDA is.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serves_merged(auto)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not serves_merged(auto)
    with pytest.raises(ValueError, match="serve"):
        LoRAConfig(rank=8, serve="both")
