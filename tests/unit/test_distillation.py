"""On-policy distillation: a teacher scores the policy's samples, and each response token's
advantage gets ``coeff * (teacher logprob - behaviour logprob)`` (reverse KL as a per-token
reward), added to the GRPO advantage or alone.

What is exact and what is not: the behaviour logprobs come from vLLM, whose kernels differ
from the torch forward, so "the policy as its own teacher gives zero" is stated on what the
reference actor computes exactly: a teacher that is the reference model gives the reference
logprobs bit for bit (same packs, same forward), and where the behaviour logprobs equal the
teacher's the signal is exactly zero. The signal itself is checked against an independent
computation (each sequence alone through the model, full log-softmax).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo.cli import main
from grpo.config import RefConfig, RunConfig
from grpo.models import build_model
from grpo.objective.advantages import distillation_advantages, group_advantages, teacher_signal
from grpo.observability.metric_names import REF_TEACHER_REVERSE_KL
from grpo.packing.packs import pack_sequences
from grpo.preflight.memory import dtype_bytes, model_shape, parameter_count, reference_memory
from grpo.testing import build_tiny_qwen2
from grpo.types import GroupedUnscoredTrajectories, ScoredTrajectory, UnscoredTrajectory
from grpo.workers.ref import RefActor

POLICY = Path(__file__).resolve().parents[2] / "assets" / "tiny_arithmetic_qwen2"
TEMPERATURE = 0.7


# A demo run in the shipped config's output_dir must not make validation refuse it.
FRESH = "overwrite_output_dir=true"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model with the policy's tokenizer (other weights, one more layer)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("teacher") / "qwen2", num_layers=3, seed=7)


# ----------------------------------------------------------------------------- the formula


def test_the_signal_is_teacher_minus_behaviour_and_zero_on_environment_tokens():
    teacher = torch.tensor([-0.5, -2.0, -7.0, -0.1])
    behaviour = torch.tensor([-1.0, -1.0, 0.0, -0.3])  # an environment token's placeholder 0
    mask = torch.tensor([True, True, False, True])
    signal = teacher_signal(teacher, behaviour, mask)
    assert signal.tolist() == pytest.approx([0.5, -1.0, 0.0, 0.2])
    assert signal[2].item() == 0.0
    # Added to the GRPO advantage with its coefficient, or alone.
    combined = distillation_advantages(signal, 0.5, torch.tensor(1.5))
    assert combined.tolist() == pytest.approx([1.75, 1.0, 1.5, 1.6])
    assert distillation_advantages(signal, 2.0).tolist() == pytest.approx([1.0, -2.0, 0.0, 0.4])
    # A reward-like constant of the loss: no gradient reaches the teacher or the sampler.
    teacher.requires_grad_(True)
    assert not distillation_advantages(teacher_signal(teacher, behaviour), 1.0).requires_grad
    with pytest.raises(ValueError, match="same shape"):
        teacher_signal(teacher[:3], behaviour)


def test_per_token_advantages_pack_as_they_are_beside_scalar_ones():
    def scored(sequence_id: str, response: list[int], advantages: torch.Tensor) -> ScoredTrajectory:
        return ScoredTrajectory(
            prompt_tokens=torch.tensor([1, 2, 3]),
            response_tokens=torch.tensor(response),
            prompt_len=3,
            response_len=len(response),
            logprobs=torch.zeros(len(response)),
            ref_logprobs=None,
            rewards=torch.ones(1),
            advantages=advantages,
            successes=torch.ones(1),
            answer="",
            sequence_id=sequence_id,
            group_id=0,
            reward_metadata={"func_names": ["r"]},
            policy_version=0,
        )

    batch = [
        scored("a", [4, 5, 6], torch.tensor([0.5, -1.0, 2.0])),
        scored("b", [7, 8], torch.tensor(1.5)),
    ]
    for share_prompts in (False, True):
        packed = pack_sequences(batch, "cpu", pad_token_id=0, share_prompts=share_prompts)
        assert packed.advantages.tolist() == [0.5, -1.0, 2.0, 1.5, 1.5]
    with pytest.raises(ValueError, match=r"scalar or have shape \(2,\)"):
        scored("c", [7, 8], torch.zeros(3))


# ----------------------------------------------------------------------------- the actor


def _groups(seed: int, with_environment_tokens: bool) -> list[GroupedUnscoredTrajectories]:
    """Two groups of three episodes with random behaviour logprobs; the second group's
    episodes have environment tokens (response_mask False) in the middle of the response."""
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for group_id, rewards in enumerate([[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]]):
        prompt = torch.randint(0, 500, (5 + group_id,), generator=generator)
        members = []
        for index, reward in enumerate(rewards):
            length = 6 + index
            mask = None
            if with_environment_tokens and group_id == 1:
                mask = torch.ones(length, dtype=torch.bool)
                mask[2:4] = False
            logprobs = -torch.rand(length, generator=generator) * 3
            if mask is not None:
                logprobs = logprobs.masked_fill(~mask, 0.0)
            members.append(
                UnscoredTrajectory(
                    prompt_tokens=prompt,
                    response_tokens=torch.randint(0, 500, (length,), generator=generator),
                    prompt_len=prompt.numel(),
                    response_len=length,
                    logprobs=logprobs,
                    answer="",
                    sequence_id=f"g{group_id}-{index}",
                    policy_version=0,
                    group_id=group_id,
                    response_mask=mask,
                    env_rewards={"score": reward},
                )
            )
        groups.append(GroupedUnscoredTrajectories.from_trajectories(members))
    return groups


def _alone_logprobs(model_dir: Path, traj: UnscoredTrajectory) -> torch.Tensor:
    """A sequence's response logprobs alone through the model: full logits, plain softmax."""
    model = build_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu")).eval()
    tokens = torch.cat([traj.prompt_tokens, traj.response_tokens])[None]
    with torch.no_grad():
        logits = model(tokens)[0].float() / TEMPERATURE
    rows = logits[traj.prompt_len - 1 : traj.prompt_len - 1 + traj.response_len]
    return rows.log_softmax(-1).gather(1, traj.response_tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("only", [False, True])
def test_each_token_gets_the_teacher_signal_and_environment_tokens_none(
    tiny_model_dir, teacher_dir, only
):
    coeff = 0.5
    actor = RefActor(
        model_dir=str(tiny_model_dir),
        target_tokens_per_batch=64,
        config=RefConfig(
            teacher_model_path=str(teacher_dir),
            distillation_coeff=coeff,
            distillation_only=only,
        ),
        load_model=False,
        temperature=TEMPERATURE,
    )
    groups = _groups(seed=0, with_environment_tokens=True)
    info, scored = actor.score(groups)

    kl_sum, kl_tokens = 0.0, 0
    for group, scored_group in zip(groups, scored):
        rewards = torch.tensor([t.env_rewards["score"] for t in group.trajectories])
        grpo = group_advantages(rewards)
        for index, (traj, result) in enumerate(zip(group.trajectories, scored_group)):
            teacher = _alone_logprobs(teacher_dir, traj)
            policy = traj.response_mask if traj.response_mask is not None else slice(None)
            expected = coeff * (teacher - traj.logprobs)
            if not only:
                expected = expected + grpo[index]
            assert result.advantages.shape == (traj.response_len,)
            torch.testing.assert_close(
                result.advantages[policy], expected[policy], rtol=0, atol=1e-5
            )
            if traj.response_mask is not None:
                # Environment tokens: the GRPO advantage unchanged (exactly 0 when alone).
                on_env = result.advantages[~traj.response_mask]
                assert on_env.tolist() == [0.0 if only else float(grpo[index])] * on_env.numel()
            kl_sum += float((traj.logprobs - teacher)[policy].sum())
            kl_tokens += traj.policy_len
    assert info["metrics"][REF_TEACHER_REVERSE_KL] == pytest.approx(kl_sum / kl_tokens, abs=1e-5)


def test_the_policy_as_its_own_teacher_gives_exactly_zero(tiny_model_dir):
    """The teacher is the reference model: its logprobs are the reference's bit for bit, and
    where the behaviour logprobs are those numbers the signal is exactly zero, so the
    advantages are exactly GRPO's (and exactly zero with distillation_only)."""
    groups = _groups(seed=1, with_environment_tokens=False)
    trajectories = [t for g in groups for t in g.trajectories]

    def actor(only: bool) -> RefActor:
        return RefActor(
            model_dir=str(tiny_model_dir),
            target_tokens_per_batch=64,
            config=RefConfig(teacher_model_path=str(tiny_model_dir), distillation_only=only),
            load_model=True,
            temperature=TEMPERATURE,
        )

    scorer = actor(only=False)
    reference, _ = scorer.reference_logprobs(trajectories)
    teacher, _ = scorer.teacher_logprobs(trajectories)
    for traj in trajectories:
        assert torch.equal(teacher[traj.sequence_id], reference[traj.sequence_id])
        traj.logprobs = reference[traj.sequence_id].clone()  # the sampler agreeing exactly

    info, scored = scorer.score(groups)
    for group, scored_group in zip(groups, scored):
        rewards = torch.tensor([t.env_rewards["score"] for t in group.trajectories])
        for grpo, result in zip(group_advantages(rewards), scored_group):
            assert torch.equal(result.advantages, grpo.expand(result.response_len))
            assert torch.equal(result.ref_logprobs, reference[result.sequence_id])
    assert info["metrics"][REF_TEACHER_REVERSE_KL] == 0.0

    _, scored = actor(only=True).score(groups)
    assert all(not result.advantages.any() for group in scored for result in group)


# ----------------------------------------------------------------------------- refusals


def refusal(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    """The one line `grpo validate tiny_arithmetic_cpu` refuses ``overrides`` with."""
    assert main(["validate", "tiny_arithmetic_cpu", *overrides]) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    prefix = "grpo validate: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


def _teacher_copy(tmp_path: Path) -> Path:
    """A copy of the demo model's folder, to change its tokenizer files."""
    folder = tmp_path / "teacher"
    shutil.copytree(POLICY, folder)
    return folder


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _swap_zero_and_one(tokenizer: dict) -> None:
    vocab = tokenizer["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]


def test_a_teacher_with_the_policys_tokenizer_validates(tmp_path):
    teacher = _teacher_copy(tmp_path)
    assert (
        main(["validate", "tiny_arithmetic_cpu", f"ref.teacher_model_path={teacher}", FRESH]) == 0
    )


def test_distillation_settings_without_a_teacher_are_refused(capsys):
    for override, value in (
        ("ref.distillation_coeff=0.5", "0.5"),
        ("ref.distillation_only=true", "true"),
        ("ref.teacher_dtype=bf16", "'bf16'"),
    ):
        line = refusal(capsys, override, "ref.filter_zero_variance_groups=false")
        key = override.split("=")[0]
        assert line.startswith(f"{key}: {value} configures on-policy distillation, but "), line
        assert "ref.teacher_model_path is null" in line


def test_a_missing_or_incomplete_teacher_folder_is_refused(capsys, tmp_path):
    line = refusal(capsys, f"ref.teacher_model_path={tmp_path / 'nowhere'}")
    assert line == f"ref.teacher_model_path: teacher folder {tmp_path / 'nowhere'} does not exist"
    teacher = _teacher_copy(tmp_path)
    (teacher / "model.safetensors").unlink()
    line = refusal(capsys, f"ref.teacher_model_path={teacher}")
    assert line.startswith(f"ref.teacher_model_path: {teacher} lacks *.safetensors"), line


@pytest.mark.parametrize(
    "change, says",
    [
        # Another vocabulary size: a tokenizer trained with fewer merges.
        (
            lambda f: _edit_json(f / "tokenizer.json", lambda t: t["model"]["vocab"].popitem()),
            "its vocabulary has 511 tokens, the policy's 512",
        ),
        # The same size, an added token at another id.
        (
            lambda f: _edit_json(
                f / "tokenizer.json",
                lambda t: t["added_tokens"][1].update(content="<|tool|>"),
            ),
            "added token '<|im_start|>' is absent in the teacher's, id 510 (special) in the policy's",
        ),
        # A special token that is not special in the teacher's.
        (
            lambda f: _edit_json(
                f / "tokenizer.json", lambda t: t["added_tokens"][0].update(special=False)
            ),
            "added token '<|endoftext|>' is id 509 (not special) in the teacher's, id 509 (special) "
            "in the policy's",
        ),
        # Another eos.
        (
            lambda f: _edit_json(
                f / "tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>")
            ),
            "its eos token is '<|endoftext|>', the policy's '<|im_end|>'",
        ),
        # Two regular tokens swapped.
        (lambda f: _edit_json(f / "tokenizer.json", _swap_zero_and_one), "token '0' has id"),
    ],
)
def test_a_teacher_whose_tokenizer_differs_is_refused(capsys, tmp_path, change, says):
    teacher = _teacher_copy(tmp_path)
    change(teacher)
    line = refusal(capsys, f"ref.teacher_model_path={teacher}")
    assert line.startswith(
        "ref.teacher_model_path: the teacher's tokenizer is not the policy's (base_model_path): "
    ), line
    assert says in line, line


def test_distillation_alone_refuses_dropping_groups_by_their_rewards(capsys):
    line = refusal(
        capsys,
        f"ref.teacher_model_path={POLICY}",
        "ref.distillation_only=true",
        "ref.filter_zero_variance_groups=true",
    )
    assert line.startswith("ref.distillation_only: true trains on the teacher signal alone"), line
    assert "set ref.filter_zero_variance_groups: false" in line


# ----------------------------------------------------------------------------- memory plan


def test_the_teachers_weights_are_on_the_reference_role(capsys, teacher_dir):
    """LoRA and no KL term: the reference actor loads no reference model, and still the
    teacher; with a KL term it holds both, and the larger forward (they run one after the
    other)."""
    values = {
        "base_model_path": str(POLICY),
        "output_dir": "unused",
        "orchestration": {"num_steps": 1},
        "reward_functions": [{"_component_": "builtins.dict"}],
        "metric_logger": {"_component_": "builtins.dict"},
        "ref": {"teacher_model_path": str(teacher_dir), "teacher_dtype": "bf16"},
        "training": {"lora": {"rank": 8}},
    }
    shape = model_shape(json.loads((POLICY / "config.json").read_text()))
    teacher = model_shape(json.loads((teacher_dir / "config.json").read_text()))
    lora = reference_memory(RunConfig.model_validate(values), shape, teacher)
    teacher_bytes = parameter_count(teacher).total * dtype_bytes("bf16")
    assert lora is not None
    assert [(part.name, part.nbytes) for part in lora.parts[:1]] == [
        ("teacher weights", teacher_bytes)
    ]
    values["training"] = {"loss": {"_component_": "grpo.objective.loss.GRPOLoss", "kl_coeff": 0.1}}
    both = reference_memory(RunConfig.model_validate(values), shape, teacher)
    assert [part.name for part in both.parts] == [
        "weights",
        "teacher weights",
        "forward",
        "CUDA context",
    ]
    with pytest.raises(ValueError, match="give teacher_shape"):
        reference_memory(RunConfig.model_validate(values), shape)

    overrides = [f"ref.teacher_model_path={teacher_dir}", "ref.num_gpus=1", "ray.num_gpus=1"]
    assert (
        main(["validate", "tiny_arithmetic_cpu", *overrides, FRESH, "--gpu-memory", "24GiB"]) == 0
    )
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "ref[0]" in line]
    assert ": teacher weights 2 MiB + forward ~" in line, line
