"""The loss and every gradient do not depend on how a batch is split into packs.

A batch of scored sequences of mixed lengths is trained on a tiny torchtune Qwen2 model either
as one pack, or split by `plan_packs` into several micro-batches whose gradients accumulate
with the whole batch's normaliser. Both must give the same loss and parameter gradients; so
must shared-prompt packs, sharded over data-parallel ranks by whole prompt groups. The same
holds for multi-turn episodes, whose environment tokens (``response_mask`` False) the loss
skips.
"""

import copy
import dataclasses

import pytest
import torch
from torchtune.models.qwen2 import qwen2

from grpo.objective.loss import AGGREGATIONS, GRPOLoss, combine_stats
from grpo.packing.attention import use_packed_attention
from grpo.packing.logprobs import model_response_logprobs
from grpo.packing.packs import (
    pack_sequences,
    plan_packs,
    plan_sequence_packs,
    shard_batch,
    shared_prompt_units,
    unpack_response_logprobs,
)
from grpo.types import ScoredTrajectory

VOCAB_SIZE = 256
PAD_TOKEN_ID = 0
GROUP_SIZES = (4, 3, 3)
MAX_RESPONSE_LEN = 24
BUDGET = 64  # tokens per micro-batch: the ~180-token batch needs at least 3 packs


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = qwen2(
        vocab_size=VOCAB_SIZE,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=128,
        intermediate_dim=256,
        max_seq_len=512,
    )
    return use_packed_attention(model.float())


def _episode_mask(response_len: int, generator: torch.Generator) -> torch.Tensor:
    """A multi-turn ``response_mask``: policy turns (True) and environment turns (False)."""
    mask = torch.ones(response_len, dtype=torch.bool)
    start = 1
    while start < response_len - 1:
        env_len = int(torch.randint(1, 5, (), generator=generator))
        mask[start : start + env_len] = False
        start += env_len + int(torch.randint(1, 6, (), generator=generator))
    return mask


def _scored_batch(
    model: torch.nn.Module, shared_prompts: bool = False, masked: bool = False
) -> list[ScoredTrajectory]:
    """Sequences whose behaviour and reference logprobs differ from the model's.

    With ``shared_prompts`` the members of a group answer one prompt, as in GRPO. With
    ``masked`` they are multi-turn episodes: runs of environment tokens in each response.
    """
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for group_id, group_size in enumerate(GROUP_SIZES):
        rewards = torch.rand(group_size, generator=generator)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        group_prompt = torch.randint(
            1,
            VOCAB_SIZE,
            (int(torch.randint(3, 13, (), generator=generator)),),
            generator=generator,
        )
        for index in range(group_size):
            prompt_len = int(torch.randint(3, 13, (), generator=generator))
            prompt = torch.randint(1, VOCAB_SIZE, (prompt_len,), generator=generator)
            if shared_prompts:
                prompt, prompt_len = group_prompt, group_prompt.numel()
            response_len = int(torch.randint(1, MAX_RESPONSE_LEN + 1, (), generator=generator))
            sequences.append(
                ScoredTrajectory(
                    prompt_tokens=prompt,
                    response_tokens=torch.randint(
                        1, VOCAB_SIZE, (response_len,), generator=generator
                    ),
                    prompt_len=prompt_len,
                    response_len=response_len,
                    logprobs=torch.zeros(response_len),
                    ref_logprobs=torch.zeros(response_len),
                    rewards=rewards[index : index + 1],
                    advantages=advantages[index],
                    successes=(rewards[index : index + 1] > 0.5).float(),
                    answer="",
                    sequence_id=f"g{group_id}-s{index}",
                    group_id=group_id,
                    reward_metadata={"func_names": ["random"]},
                    policy_version=0,
                    response_mask=_episode_mask(response_len, generator) if masked else None,
                )
            )
    # Behaviour (sampler) and reference logprobs: the model's own, perturbed, so ratios spread
    # on both sides of the clip range and the KL term is not zero.
    with torch.no_grad():
        packed = pack_sequences(sequences, "cpu", PAD_TOKEN_ID)
        pi_logprobs = unpack_response_logprobs(packed, model_response_logprobs(model, packed))
    batch = []
    for sequence, pi in zip(sequences, pi_logprobs):
        batch.append(
            dataclasses.replace(
                sequence,
                logprobs=pi + 0.3 * torch.randn(pi.shape, generator=generator),
                ref_logprobs=pi + 0.2 * torch.randn(pi.shape, generator=generator),
            )
        )
    return batch


@pytest.fixture(scope="module", params=[False, True], ids=["single_turn", "multi_turn"])
def model_and_batch(request):
    model = _tiny_model()
    batch = _scored_batch(model, masked=request.param)
    if request.param:
        assert 0 < sum(seq.policy_len for seq in batch) < sum(seq.response_len for seq in batch)
    return model, batch


def _loss_and_gradients(model, loss_fn, packs, loss_normalizer):
    """Accumulate gradients over ``packs``; return the summed loss, stats and gradients."""
    model.zero_grad(set_to_none=True)
    all_stats = []
    for packed in packs:
        stats = loss_fn.compute_loss_from_logprobs(
            model_response_logprobs(model, packed),
            packed.ref_logprobs,
            packed.advantages,
            packed.behavior_logprobs,
            response_lens=packed.response_lens,
            loss_mask=packed.loss_mask,
            loss_normalizer=loss_normalizer,
        )
        stats.loss.backward()
        all_stats.append(stats)
    gradients = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    total_loss = sum(stats.loss.detach() for stats in all_stats)
    return total_loss, all_stats, gradients


@pytest.mark.parametrize("mask_kind", ["dense", "varlen"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradients_do_not_depend_on_the_split(model_and_batch, aggregation, mask_kind):
    model, batch = model_and_batch
    model = copy.deepcopy(model)
    loss_fn = GRPOLoss(
        epsilon_low=0.2,
        epsilon_high=0.28,
        kl_coeff=0.1,
        kl_estimator="k3",
        aggregation=aggregation,
        max_response_len=MAX_RESPONSE_LEN,
    )
    normalizer = loss_fn.batch_loss_normalizer([seq.policy_len for seq in batch])
    if aggregation == "token_mean":
        assert normalizer == sum(seq.policy_len for seq in batch)
    else:
        assert normalizer == len(batch)

    whole_pack = pack_sequences(batch, "cpu", PAD_TOKEN_ID, mask_kind=mask_kind)
    whole_loss, (whole_stats,), whole_gradients = _loss_and_gradients(
        model, loss_fn, [whole_pack], normalizer
    )
    # The batch exercises clipping on real ratios, not the on-policy ratio of 1.
    assert 0.0 < whole_stats.clipfrac.item() < 1.0
    assert whole_stats.approx_policy_kls.item() > 0.01

    plan = plan_packs([seq.total_len for seq in batch], BUDGET)
    assert len(plan) >= 3
    # Micro-batches padded to the budget: tail padding must not change anything either.
    micro_packs = [
        pack_sequences(
            [batch[i] for i in indices],
            "cpu",
            PAD_TOKEN_ID,
            target_tokens_per_batch=BUDGET,
            mask_kind=mask_kind,
        )
        for indices in plan
    ]
    assert any(packed.padding_tokens > 0 for packed in micro_packs)
    split_loss, split_stats, split_gradients = _loss_and_gradients(
        model, loss_fn, micro_packs, normalizer
    )

    torch.testing.assert_close(split_loss, whole_loss.detach(), rtol=1e-5, atol=1e-7)
    for name, gradient in whole_gradients.items():
        assert gradient.abs().max() > 0, name
        torch.testing.assert_close(split_gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)

    combined = combine_stats(split_stats)
    for name in ("loss", "policy_loss", "kl_loss", "ratios", "clipfrac", "approx_policy_kls"):
        torch.testing.assert_close(
            getattr(combined, name), getattr(whole_stats, name).detach(), rtol=1e-5, atol=1e-7
        )


def test_local_normalisation_depends_on_the_split(model_and_batch):
    """Without the whole-batch normaliser, micro-batch losses do NOT add up to the batch's."""
    model, batch = model_and_batch
    model = copy.deepcopy(model)
    loss_fn = GRPOLoss(epsilon_high=0.28)
    whole_loss, _, _ = _loss_and_gradients(
        model, loss_fn, [pack_sequences(batch, "cpu", PAD_TOKEN_ID)], None
    )
    plan = plan_packs([seq.total_len for seq in batch], BUDGET)
    micro_packs = [pack_sequences([batch[i] for i in ids], "cpu", PAD_TOKEN_ID) for ids in plan]
    split_loss, _, _ = _loss_and_gradients(model, loss_fn, micro_packs, None)
    assert not torch.allclose(split_loss, whole_loss, rtol=1e-3, atol=0)


@pytest.mark.parametrize("masked", [False, True], ids=["single_turn", "multi_turn"])
@pytest.mark.parametrize("mask_kind", ["dense", "varlen"])
def test_shared_prompts_over_two_ranks_give_the_unshared_whole_batch(mask_kind, masked):
    """Shared-prompt micro-batches, sharded over 2 ranks as the trainer does, accumulate the
    same loss and gradients as the whole batch packed without sharing (with environment
    tokens masked out of the loss, too)."""
    model = _tiny_model()
    batch = _scored_batch(model, shared_prompts=True, masked=masked)
    loss_fn = GRPOLoss(epsilon_high=0.28, kl_coeff=0.1, kl_estimator="k3")
    normalizer = loss_fn.batch_loss_normalizer([seq.policy_len for seq in batch])
    whole_pack = pack_sequences(batch, "cpu", PAD_TOKEN_ID, mask_kind=mask_kind)
    whole_loss, _, whole_gradients = _loss_and_gradients(model, loss_fn, [whole_pack], normalizer)

    budget = 48
    assert len(shared_prompt_units(batch, budget)) > len(GROUP_SIZES), "no group was split"
    micro_packs = []
    for shard in shard_batch(batch, 2, budget, share_prompts=True):
        members = [batch[i] for i in shard]
        for indices in plan_sequence_packs(members, budget, share_prompts=True):
            micro_packs.append(
                pack_sequences(
                    [members[i] for i in indices],
                    "cpu",
                    PAD_TOKEN_ID,
                    target_tokens_per_batch=budget,
                    mask_kind=mask_kind,
                    share_prompts=True,
                )
            )
    assert sum(packed.shared_prompt_tokens for packed in micro_packs) > 0
    # The sum over both ranks' micro-batches is what FSDP's reduce gives the update.
    split_loss, _, split_gradients = _loss_and_gradients(model, loss_fn, micro_packs, normalizer)
    torch.testing.assert_close(split_loss, whole_loss.detach(), rtol=1e-5, atol=1e-7)
    for name, gradient in whole_gradients.items():
        torch.testing.assert_close(split_gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)
