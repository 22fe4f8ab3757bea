"""Environment tokens of multi-turn episodes (``response_mask`` False) are never trained.

The mask travels from the trajectory types through shared-prompt packing (``loss_mask``,
aligned with the pack's targets) to the loss, which must then equal the loss of the policy
tokens alone in value, gradient and every metric.
"""

import dataclasses
import math

import pytest
import torch

from grpo.objective.loss import GRPOLoss
from grpo.packing.packs import pack_sequences
from grpo.types import ScoredTrajectory, UnscoredTrajectory


def test_hand_computed_loss_skips_environment_tokens():
    """3 tokens, the middle one the environment's: token_mean over tokens 1 and 3 only."""
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.2)
    pi = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    behaviour = torch.tensor([-1.0, -5.0, -0.7])
    advantages = torch.ones(3)
    stats = loss_fn.compute_loss_from_logprobs(
        pi,
        None,
        advantages,
        behaviour,
        response_lens=torch.tensor([3]),
        loss_mask=torch.tensor([True, False, True]),
    )
    # Token 1: ratio 1, term -1. Token 3: ratio exp(0.2) = 1.221 > 1.2, clipped: term -1.2.
    # The environment token (ratio exp(3) = 20) would have been clipped too; it is not counted.
    assert stats.loss.item() == pytest.approx(-(1.0 + 1.2) / 2, abs=1e-6)
    assert stats.clipfrac.item() == pytest.approx(0.5)
    assert stats.ratios.item() == pytest.approx((1.0 + math.exp(0.2)) / 2, abs=1e-6)
    assert stats.metadata["num_tokens"] == 2
    stats.loss.backward()
    # Token 1 unclipped: d(-ratio)/d pi = -ratio / 2; token 3 clipped: 0; token 2 masked: 0.
    assert pi.grad.tolist() == pytest.approx([-0.5, 0.0, 0.0], abs=1e-6)
    assert pi.grad[1].item() == 0.0


@pytest.mark.parametrize(
    "options",
    [
        {"aggregation": "token_mean", "kl_coeff": 0.1},
        {"aggregation": "seq_mean_token_mean", "kl_coeff": 0.1, "kl_estimator": "k2"},
        {"aggregation": "seq_mean_token_sum_norm", "max_response_len": 16},
        {"tis_cap": 2.0, "tis_level": "sequence"},
        {"ratio_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    ],
    ids=["token_mean", "seq_mean", "dr_grpo", "tis_sequence", "gspo"],
)
def test_masked_loss_equals_the_loss_of_the_policy_tokens_alone(options):
    generator = torch.Generator().manual_seed(0)
    response_lens = torch.tensor([5, 7, 4])
    num_tokens = int(response_lens.sum())
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[[1, 2, 6, 7, 8, 13]] = False  # environment turns inside each episode
    pi = torch.randn(num_tokens, generator=generator) - 1.0
    behaviour = pi + 0.3 * torch.randn(num_tokens, generator=generator)
    old = pi + 0.1 * torch.randn(num_tokens, generator=generator)
    ref = pi + 0.2 * torch.randn(num_tokens, generator=generator)
    advantages = torch.tensor([1.0, -0.5, 0.7]).repeat_interleave(response_lens)
    loss_fn = GRPOLoss(**options)

    masked_pi = pi.clone().requires_grad_(True)
    masked = loss_fn.compute_loss_from_logprobs(
        masked_pi,
        ref,
        advantages,
        behaviour,
        old_logprobs=old,
        response_lens=response_lens,
        loss_mask=mask,
    )
    masked.loss.backward()

    policy_lens = torch.tensor([3, 4, 3])
    alone_pi = pi[mask].clone().requires_grad_(True)
    alone = loss_fn.compute_loss_from_logprobs(
        alone_pi,
        ref[mask],
        advantages[mask],
        behaviour[mask],
        old_logprobs=old[mask],
        response_lens=policy_lens,
    )
    alone.loss.backward()

    for name in ("loss", "policy_loss", "kl_loss", "ratios", "clipfrac", "approx_policy_kls"):
        torch.testing.assert_close(getattr(masked, name), getattr(alone, name), msg=name)
    for name in ("kl_to_ref", "mismatch_kl", "mismatch_max_abs"):
        torch.testing.assert_close(masked.metadata[name], alone.metadata[name], msg=name)
    assert masked.metadata["num_tokens"] == alone.metadata["num_tokens"] == 10
    assert masked_pi.grad[~mask].abs().max().item() == 0.0
    torch.testing.assert_close(masked_pi.grad[mask], alone_pi.grad)


def _episode(sequence_id: str, prompt: list[int], response: list[int], mask: list[bool] | None):
    return ScoredTrajectory(
        prompt_tokens=torch.tensor(prompt),
        response_tokens=torch.tensor(response),
        prompt_len=len(prompt),
        response_len=len(response),
        logprobs=torch.zeros(len(response)),
        ref_logprobs=torch.zeros(len(response)),
        rewards=torch.ones(1),
        advantages=torch.tensor(1.0),
        successes=torch.ones(1),
        answer="",
        sequence_id=sequence_id,
        group_id=0,
        reward_metadata={"func_names": ["r"]},
        policy_version=0,
        response_mask=None if mask is None else torch.tensor(mask),
    )


@pytest.mark.parametrize("share_prompts", [False, True])
def test_pack_carries_the_masks_in_target_order(share_prompts):
    batch = [
        _episode("a", [1, 2, 3], [4, 5, 6, 7], [True, False, False, True]),
        _episode("b", [1, 2, 3], [8, 9], None),  # a single-turn response: all trained
        _episode("c", [1, 2, 3], [10, 11, 12], [True, True, False]),
    ]
    packed = pack_sequences(batch, "cpu", pad_token_id=0, share_prompts=share_prompts)
    assert packed.targets.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert packed.loss_mask.tolist() == [1, 0, 0, 1, 1, 1, 1, 1, 0]
    assert packed.policy_lens.tolist() == [2, 2, 2]
    assert [seq.policy_len for seq in batch] == [2, 2, 2]
    # Environment tokens stay in the sequence: the forward sees them, as the sampler did.
    assert packed.response_mask.sum().item() == 9


def test_single_turn_packs_have_no_loss_mask():
    packed = pack_sequences([_episode("a", [1, 2], [3, 4], None)], "cpu", pad_token_id=0)
    assert packed.loss_mask is None
    assert packed.policy_lens.tolist() == [2]


def test_a_malformed_response_mask_fails_where_it_is_made():
    with pytest.raises(ValueError, match=r"response_mask must have shape \(3,\)"):
        UnscoredTrajectory(
            prompt_tokens=torch.tensor([1]),
            response_tokens=torch.tensor([2, 3, 4]),
            prompt_len=1,
            response_len=3,
            logprobs=torch.zeros(3),
            answer="",
            sequence_id="s",
            policy_version=0,
            group_id=0,
            response_mask=torch.tensor([True, False]),
        )
    with pytest.raises(ValueError, match="response_mask must be a bool tensor"):
        dataclasses.replace(_episode("s", [1], [2, 3], None), response_mask=torch.ones(2))
