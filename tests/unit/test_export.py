"""``grpo export``: a LoRA checkpoint as a PEFT folder and merged into its base model.

The merged folder loads in transformers with the LoRA model's logits (every family); the PEFT
folder is the checkpoint's adapter; a checkpoint is found from a bare PEFT folder, a run folder
or ``checkpoints/latest``; every refusal is one line naming the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo import models
from grpo.cli import main
from grpo.config import LoRAConfig
from grpo.models.lora import (
    ADAPTER_CONFIG_FILE,
    adapter_state_dict,
    apply_lora,
    load_peft_adapter,
    lora_modules,
    peft_adapter_config,
    peft_adapter_state_dict,
    save_peft_adapter,
)
from grpo.testing import (
    TOKENIZER_FILES,
    build_tiny_llama,
    build_tiny_qwen2,
    build_tiny_qwen3,
)

BUILDERS = {"qwen2": build_tiny_qwen2, "qwen3": build_tiny_qwen3, "llama": build_tiny_llama}
CONFIG = LoRAConfig(
    rank=8,
    alpha=16.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def lora_checkpoint(model_dir: Path, checkpoint_dir: Path) -> nn.Module:
    """Write ``checkpoint_dir/adapter`` as a LoRA run does; return the LoRA model (eval)."""
    model = models.build_model(model_dir)
    torch.manual_seed(0)
    apply_lora(model, CONFIG)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, module in lora_modules(model):
            weight = module.lora_b.weight
            weight.copy_(0.05 * torch.randn(weight.shape, generator=generator))
    peft = peft_adapter_state_dict(
        adapter_state_dict(model.state_dict()), models.load_hf_config(model_dir)
    )
    save_peft_adapter(checkpoint_dir / "adapter", peft, peft_adapter_config(CONFIG, model_dir))
    (checkpoint_dir / "state.json").write_text("{}")
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    """Per family: ``(checkpoint folder, LoRA model)`` (read-only)."""
    root = tmp_path_factory.mktemp("export")
    result = {}
    for family, build in BUILDERS.items():
        model_dir = build(root / "models" / family)
        checkpoint = root / "checkpoints" / family
        result[family] = (checkpoint, lora_checkpoint(model_dir, checkpoint))
    return result


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *parts: str) -> None:
    assert err.startswith("grpo export: error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, (part, err)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_merged_folder_loads_in_transformers_with_the_lora_logits(
    family, checkpoints, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    checkpoint, model = checkpoints[family]
    out = tmp_path / "merged"
    code, printed, err = export(capsys, checkpoint, "--merged", out)
    assert (code, printed, err) == (0, f"{out}\n", "")
    base_dir = Path(load_peft_adapter(checkpoint / "adapter")[1]["base_model_name_or_path"])
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (base_dir / name).read_bytes()
    assert models.load_hf_config(out)["model_type"] == family

    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x)
        hf_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        theirs = hf_model(x).logits
        with_build_model = models.build_model(out).eval()(x)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    torch.testing.assert_close(with_build_model, ours, rtol=0, atol=1e-5)


def test_peft_folder_is_the_checkpoints_adapter(checkpoints, tmp_path, capsys):
    checkpoint, _ = checkpoints["llama"]
    out = tmp_path / "peft"
    assert export(capsys, checkpoint, "--peft", out)[0] == 0
    tensors, config = load_peft_adapter(out)
    expected_tensors, expected_config = load_peft_adapter(checkpoint / "adapter")
    assert config == expected_config
    assert tensors.keys() == expected_tensors.keys()
    assert all(torch.equal(tensors[n], expected_tensors[n]) for n in tensors)
    # A bare PEFT folder is a checkpoint too; both outputs at once.
    again, merged = tmp_path / "again", tmp_path / "merged"
    code, printed, _ = export(capsys, out, "--peft", again, "--merged", merged)
    assert (code, printed) == (0, f"{again}\n{merged}\n")
    assert (again / ADAPTER_CONFIG_FILE).is_file() and (merged / "config.json").is_file()


def test_a_run_folder_or_its_latest_file_means_the_newest_checkpoint(checkpoints, tmp_path, capsys):
    checkpoint, _ = checkpoints["qwen2"]
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    assert export(capsys, run, "--peft", tmp_path / "a")[0] == 0
    assert export(capsys, run / "checkpoints" / "latest", "--peft", tmp_path / "b")[0] == 0
    assert (tmp_path / "b" / ADAPTER_CONFIG_FILE).is_file()


def test_refusals_are_one_line(checkpoints, tmp_path, capsys):
    checkpoint, _ = checkpoints["qwen2"]
    code, _, err = export(capsys, tmp_path / "nowhere", "--peft", tmp_path / "x")
    assert code == 2
    assert_one_line_error(err, str(tmp_path / "nowhere"), "does not exist")

    code, _, err = export(capsys, checkpoint)
    assert code == 2
    assert_one_line_error(err, "--peft", "--merged")

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = export(capsys, empty, "--peft", tmp_path / "x")
    assert code == 1
    assert_one_line_error(err, str(empty), "holds no LoRA adapter")

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = export(capsys, checkpoint, "--merged", taken)
    assert code == 1
    assert_one_line_error(err, str(taken), "not empty", "--overwrite")
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
    assert export(capsys, checkpoint, "--peft", taken, "--overwrite")[0] == 0
    assert not (taken / "keep.txt").exists()

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code, _, err = export(capsys, checkpoint, "--peft", a_file / "out")
    assert code == 1
    assert_one_line_error(err, str(a_file), "is a file")

    code, _, err = export(capsys, checkpoint, "--peft", checkpoint / "adapter", "--overwrite")
    assert code == 1
    assert_one_line_error(err, "would replace the checkpoint")


def test_merge_refuses_a_missing_or_mismatched_base(checkpoints, tmp_path, capsys):
    checkpoint, _ = checkpoints["qwen2"]
    adapter = tmp_path / "adapter"
    shutil.copytree(checkpoint / "adapter", adapter)
    config = json.loads((adapter / ADAPTER_CONFIG_FILE).read_text())

    (adapter / ADAPTER_CONFIG_FILE).write_text(
        json.dumps({**config, "base_model_name_or_path": str(tmp_path / "gone")})
    )
    code, _, err = export(capsys, adapter, "--merged", tmp_path / "m")
    assert code == 1
    assert_one_line_error(err, str(tmp_path / "gone"), "not a local model folder")
    assert export(capsys, adapter, "--peft", tmp_path / "p")[0] == 0  # no base needed

    # The Qwen3 base has other shapes (head_dim 64 x 4 heads): the adapter does not fit.
    qwen3_base = load_peft_adapter(checkpoints["qwen3"][0] / "adapter")[1]
    (adapter / ADAPTER_CONFIG_FILE).write_text(
        json.dumps({**config, "base_model_name_or_path": qwen3_base["base_model_name_or_path"]})
    )
    code, _, err = export(capsys, adapter, "--merged", tmp_path / "m")
    assert code == 1
    assert_one_line_error(err, "cannot merge", str(adapter))
    assert not (tmp_path / "m").exists()

    (adapter / ADAPTER_CONFIG_FILE).write_text(json.dumps({**config, "use_dora": True}))
    code, _, err = export(capsys, adapter, "--merged", tmp_path / "m")
    assert code == 1
    assert_one_line_error(err, "use_dora", "plain LoRA")
