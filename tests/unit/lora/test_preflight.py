"""`grpo.preflight.lora.lora_problems`: ``training.lora`` against vLLM and the model folder.

Each bad input gives one line naming its key; ``grpo validate`` (`load_run_config`) reports it.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpo.config import ConfigError
from grpo.preflight import load_run_config
from grpo.preflight.lora import VLLM_MAX_LORA_RANKS, lora_problems

# Served as a vLLM adapter, which vLLM's LoRA limits apply to.
LORA = {
    "rank": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "target_modules": ["q_proj", "gate_proj"],
    "serve": "adapter",
}


def model_folder(path: Path, modules: tuple[str, ...]) -> Path:
    """A model folder whose checkpoint holds layer 0's weights of ``modules`` only."""
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    tensors = {f"model.layers.0.{module}.weight": torch.zeros(2, 2) for module in modules}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def values(
    lora: dict | None = LORA,
    engine_args: dict | None = None,
    model: Path | None = None,
    collector_gpus: float = 0,
):
    return {
        "base_model_path": str(model) if model else None,
        "training": {"lora": lora},
        "inference": {"engine_args": engine_args or {}, "num_gpus": collector_gpus},
    }


def test_vllm_ranks_are_the_installed_vllms():
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_MAX_LORA_RANKS == typing.get_args(MaxLoRARanks)


def test_full_fine_tuning_and_a_good_adapter_pass(tmp_path):
    model = model_folder(tmp_path / "m", ("self_attn.q_proj", "mlp.gate_proj"))
    assert lora_problems(values(None, {"enable_lora": False}, model)) == []
    assert lora_problems(values(engine_args={"max_lora_rank": 8}, model=model)) == []
    assert lora_problems(values({**LORA, "rank": 512})) == []


def test_rank_above_vllms_largest():
    assert lora_problems(values({**LORA, "rank": 1024})) == [
        "training.lora.rank: 1024 is above 512, the largest rank vLLM serves"
    ]


def test_max_lora_rank_not_one_of_vllms_or_below_the_rank():
    [problem] = lora_problems(values(engine_args={"max_lora_rank": 4}))
    assert problem.startswith("inference.engine_args.max_lora_rank: 4 is not one of vLLM's")
    assert "1, 8, 16, 32, 64, 128, 256, 320, 512" in problem
    [problem] = lora_problems(values({**LORA, "rank": 16}, {"max_lora_rank": 8}))
    assert problem.startswith("training.lora.rank: 16 is above inference.engine_args.max_lora_rank")


def test_enable_lora_false_is_refused():
    [problem] = lora_problems(values(engine_args={"enable_lora": False}))
    assert problem.startswith("inference.engine_args.enable_lora: false, but training.lora")
    assert lora_problems(values(engine_args={"enable_lora": True})) == []


def test_served_merged_vllms_lora_limits_do_not_apply():
    """Merged into the base weights (explicitly, or by auto on collectors without a GPU) the
    engine runs without LoRA; auto on GPU collectors serves the adapter and is checked."""
    off_and_capped = {"enable_lora": False, "max_lora_rank": 8}
    merged = {**LORA, "rank": 1024, "serve": "merged"}
    assert lora_problems(values(merged, off_and_capped)) == []
    auto = {**LORA, "rank": 16, "serve": "auto"}
    assert lora_problems(values(auto, off_and_capped)) == []
    problems = lora_problems(values(auto, off_and_capped, collector_gpus=1))
    assert [p.split(":")[0] for p in problems] == [
        "inference.engine_args.enable_lora",
        "training.lora.rank",
    ]
    assert "training.lora.serve: merged" in problems[0]


def test_a_target_the_model_lacks(tmp_path):
    model = model_folder(tmp_path / "m", ("self_attn.q_proj",))
    [problem] = lora_problems(values(model=model))
    assert problem.startswith("training.lora.target_modules: the model in")
    assert "has no gate_proj layer" in problem
    # Unreadable weights are reported by the model-folder check, not here.
    (model / "model.safetensors").write_bytes(b"")
    assert lora_problems(values(model=model)) == []


def test_grpo_validate_reports_it(tmp_path):
    overrides = [
        f"output_dir={tmp_path / 'out'}",
        "training.lora={rank: 1024, target_modules: [q_proj], serve: adapter}",
        "inference.engine_args.enable_lora=false",
    ]
    with pytest.raises(ConfigError) as info:
        load_run_config("tiny_arithmetic_cpu", overrides)
    assert info.value.problems == [
        "training.lora.rank: 1024 is above 512, the largest rank vLLM serves",
        "inference.engine_args.enable_lora: false, but training.lora trains an adapter the "
        "collectors serve through vLLM's LoRA support; remove the key, or serve it merged "
        "(training.lora.serve: merged)",
    ]


def test_lora_keys_can_be_set_one_by_one_on_a_config_without_lora(tmp_path):
    """``training.lora.rank=8`` on a config whose ``training.lora`` is unset creates the section
    with the other options at their defaults; a typo below it gets a suggestion."""
    from grpo.config import load_config

    fresh = f"output_dir={tmp_path / 'out'}"
    cfg = load_config("tiny_arithmetic_cpu", [fresh, "training.lora.rank=8"])
    assert cfg.training.lora is not None and cfg.training.lora.rank == 8
    # Served merged on CPU collectors: vLLM's LoRA switch does not matter.
    load_run_config(
        "tiny_arithmetic_cpu",
        [fresh, "training.lora.rank=8", "inference.engine_args.enable_lora=false"],
    )
    with pytest.raises(ConfigError) as info:
        load_config("tiny_arithmetic_cpu", [fresh, "training.lora.rnak=8"])
    assert "did you mean training.lora.rank?" in info.value.problems[0]


def test_schema_errors_below_training_lora_name_the_whole_key():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config("tiny_arithmetic_lora_cpu", ["training.lora.target_modules=[q_proj, qkv]"])
    [problem] = info.value.problems
    assert problem.startswith("training.lora.target_modules[1]: must be one of q_proj")
    with pytest.raises(ConfigError) as info:
        load_config("tiny_arithmetic_lora_cpu", ["training.lora.rnk=3"])
    assert "did you mean training.lora.rank?" in info.value.problems[0]
