"""Off-policy correction in the GRPO loss: TIS, the GSPO sequence ratio, mismatch metrics.

Every expected number is worked out by hand in the comments; pi_old is the trainer's
pre-update logprob, mu the sampler's (behaviour) logprob.
"""

import math

import pytest
import torch

from grpo.objective.loss import GRPOLoss, combine_stats

# Four tokens in two sequences of two, eps_low = eps_high = 0.2, tis_cap = 2.
BEHAVIOUR = [-1.0, -2.0, -0.5, -1.5]  # mu
OLD_OVER_BEHAVIOUR = [3.0, 0.5, 2.0, 1.5]  # exp(pi_old - mu)
PI_OVER_OLD = [1.1, 1.5, 0.9, 1.0]  # exp(pi - pi_old): the PPO ratio under TIS
ADVANTAGES = [1.0, 1.0, -1.0, 2.0]
RESPONSE_LENS = [2, 2]
TIS_CAP = 2.0
# -min(r * A, clamp(r, 0.8, 1.2) * A) per token, before the TIS weight, and its derivative
# with respect to pi (-A * r where the unclipped term is taken, 0 where the clip is):
#   r=1.1, A=1: inside the band         -> -1.1, grad -1.1
#   r=1.5, A=1: clipped to 1.2          -> -1.2, grad 0
#   r=0.9, A=-1: inside the band        -> +0.9, grad +0.9
#   r=1.0, A=2:                         -> -2.0, grad -2.0
PPO_TERMS = [-1.1, -1.2, 0.9, -2.0]
PPO_GRADS = [-1.1, 0.0, 0.9, -2.0]
# Token-level weights min(exp(pi_old - mu), 2): [3 -> 2, 0.5, 2, 1.5].
TOKEN_WEIGHTS = [2.0, 0.5, 2.0, 1.5]
# Sequence-level: exp(sum of the log-ratios) = 3 * 0.5 = 1.5 and 2 * 1.5 = 3 -> capped to 2.
SEQUENCE_WEIGHTS = [1.5, 1.5, 2.0, 2.0]
# k3 = r - 1 - log r for r = 3, 0.5, 2, 1.5; the sum is 3 - log(4.5).
MISMATCH_KL = (3.0 - math.log(4.5)) / 4
MISMATCH_MAX_ABS = math.log(3.0)


def _tensor(values):
    return torch.tensor(values, dtype=torch.float32)


def _tis_case():
    behaviour = _tensor(BEHAVIOUR)
    old = behaviour + _tensor(OLD_OVER_BEHAVIOUR).log()
    pi = (old + _tensor(PI_OVER_OLD).log()).requires_grad_()
    return pi, old, behaviour, _tensor(ADVANTAGES)


@pytest.mark.parametrize(
    "tis_level,weights", [("token", TOKEN_WEIGHTS), ("sequence", SEQUENCE_WEIGHTS)]
)
def test_tis_weights_the_ppo_term_against_pi_old(tis_level, weights):
    pi, old, behaviour, advantages = _tis_case()
    loss_fn = GRPOLoss(tis_cap=TIS_CAP, tis_level=tis_level)
    stats = loss_fn.compute_loss_from_logprobs(
        pi,
        None,
        advantages,
        behaviour,
        old_logprobs=old,
        response_lens=torch.tensor(RESPONSE_LENS),
    )
    # token: (-2.2 - 0.6 + 1.8 - 3.0) / 4 = -1.0; sequence: (-1.65 - 1.8 + 1.8 - 4.0) / 4.
    expected = sum(w * term for w, term in zip(weights, PPO_TERMS)) / 4
    assert expected == pytest.approx(-1.0 if tis_level == "token" else -1.4125)
    assert stats.policy_loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.loss.item() == pytest.approx(expected, abs=1e-6)
    # The ratio and the clip are those of pi against pi_old, not against mu.
    assert stats.ratios.item() == pytest.approx(sum(PI_OVER_OLD) / 4, abs=1e-6)
    assert stats.clipfrac.item() == 0.25
    stats.loss.backward()
    expected_grad = [w * g / 4 for w, g in zip(weights, PPO_GRADS)]
    torch.testing.assert_close(pi.grad, _tensor(expected_grad), rtol=1e-5, atol=1e-7)
    assert stats.metadata["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)
    assert stats.metadata["mismatch_max_abs"].item() == pytest.approx(MISMATCH_MAX_ABS, abs=1e-6)


def test_tis_on_the_first_pass_is_a_weighted_policy_gradient():
    # Without old_logprobs, pi_old is pi.detach(): ratio 1, no clip, loss -w * A per token with
    # w = min(exp(pi - mu), 2) and gradient -w * A / T.
    pi, _, behaviour, advantages = _tis_case()
    pi_old = pi.detach()
    loss_fn = GRPOLoss(tis_cap=TIS_CAP)
    stats = loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour)
    # exp(pi - mu) = 3*1.1, 0.5*1.5, 2*0.9, 1.5*1.0 = 3.3, 0.75, 1.8, 1.5 -> capped 2, 0.75, 1.8, 1.5
    weights = [2.0, 0.75, 1.8, 1.5]
    expected = -sum(w * a for w, a in zip(weights, ADVANTAGES)) / 4  # -(2 + 0.75 - 1.8 + 3) / 4
    assert stats.loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.ratios.item() == 1.0 and stats.clipfrac.item() == 0.0
    stats.loss.backward()
    torch.testing.assert_close(
        pi.grad, _tensor([-w * a / 4 for w, a in zip(weights, ADVANTAGES)]), rtol=1e-5, atol=1e-7
    )
    gaps = (pi_old - behaviour).tolist()
    expected_kl = sum(math.exp(g) - 1 - g for g in gaps) / 4
    assert stats.metadata["mismatch_kl"].item() == pytest.approx(expected_kl, abs=1e-6)
    assert stats.metadata["mismatch_max_abs"].item() == pytest.approx(max(map(abs, gaps)))


def test_without_tis_the_ratio_stays_against_behaviour_and_old_logprobs_change_nothing():
    pi, old, behaviour, advantages = _tis_case()
    loss_fn = GRPOLoss()
    with_old = loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour, old_logprobs=old)
    with_old.loss.backward()
    grad_with_old, pi.grad = pi.grad.clone(), None
    without = loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour)
    without.loss.backward()
    # Bit-identical: the default loss reads old_logprobs only for the mismatch metrics.
    assert torch.equal(with_old.loss, without.loss)
    assert torch.equal(grad_with_old, pi.grad)
    # exp(pi - mu) = 3.3, 0.75, 1.8, 1.5
    assert with_old.ratios.item() == pytest.approx((3.3 + 0.75 + 1.8 + 1.5) / 4, abs=1e-6)
    assert with_old.metadata["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)
    # Without old_logprobs pi_old is the first forward's pi.
    gaps = (pi.detach() - behaviour).tolist()
    assert without.metadata["mismatch_max_abs"].item() == pytest.approx(max(map(abs, gaps)))


def test_mismatch_is_zero_on_policy_and_combines_with_max():
    pi, old, behaviour, advantages = _tis_case()
    on_policy = GRPOLoss().compute_loss_from_logprobs(pi, None, advantages)
    assert on_policy.metadata["mismatch_kl"].item() == 0.0
    assert on_policy.metadata["mismatch_max_abs"].item() == 0.0

    loss_fn = GRPOLoss(tis_cap=TIS_CAP)
    parts = [
        loss_fn.compute_loss_from_logprobs(
            pi[part], None, advantages[part], behaviour[part], old_logprobs=old[part]
        )
        for part in (slice(0, 1), slice(1, 4))
    ]
    # The first part holds the largest gap (log 3): the max, not a sum or a mean, comes out.
    combined = combine_stats(parts)
    assert combined.metadata["mismatch_max_abs"].item() == pytest.approx(MISMATCH_MAX_ABS)
    assert combined.metadata["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)


# ---- GSPO ------------------------------------------------------------------------------------

# Two sequences, lens [2, 3], eps 0.2; pi - mu per token, one advantage per sequence.
GSPO_LENS = [2, 3]
GSPO_GAPS = [0.1, 0.3, 0.2, -0.1, 0.2]
GSPO_ADVANTAGES = [1.0, 1.0, -0.5, -0.5, -0.5]
# s_0 = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 > 1.2 with A > 0: clipped, every token -1.2
# and no gradient. s_1 = exp(mean(0.2, -0.1, 0.2)) = exp(0.1) = 1.1052, inside the band with
# A = -0.5: every token +0.5 * s_1, gradient -A * s_1 = 0.5 * s_1.
S0, S1 = math.exp(0.2), math.exp(0.1)


def _gspo_case():
    behaviour = _tensor([-1.0, -2.0, -0.5, -1.5, -0.7])
    pi = (behaviour + _tensor(GSPO_GAPS)).requires_grad_()
    return pi, behaviour, _tensor(GSPO_ADVANTAGES)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_gspo_sequence_ratio_value_clip_and_gradient(aggregation):
    pi, behaviour, advantages = _gspo_case()
    loss_fn = GRPOLoss(ratio_level="sequence", aggregation=aggregation)
    stats = loss_fn.compute_loss_from_logprobs(
        pi, None, advantages, behaviour, response_lens=torch.tensor(GSPO_LENS)
    )
    terms = [-1.2, -1.2, 0.5 * S1, 0.5 * S1, 0.5 * S1]
    grads = [0.0, 0.0, 0.5 * S1, 0.5 * S1, 0.5 * S1]
    if aggregation == "token_mean":
        expected = sum(terms) / 5  # (-2.4 + 1.5 * S1) / 5
        expected_grad = [g / 5 for g in grads]
    else:
        # GSPO's own normalisation: (1 / G) sum_i (1 / |y_i|) sum_t.
        expected = (-1.2 + 0.5 * S1) / 2
        expected_grad = [g / (3 * 2) for g in grads]
    assert stats.policy_loss.item() == pytest.approx(expected, abs=1e-6)
    # Every token carries its sequence's ratio; clipfrac counts the clipped sequence's tokens.
    assert stats.ratios.item() == pytest.approx((2 * S0 + 3 * S1) / 5, abs=1e-6)
    assert stats.clipfrac.item() == pytest.approx(2 / 5)
    stats.loss.backward()
    torch.testing.assert_close(pi.grad, _tensor(expected_grad), rtol=1e-5, atol=1e-7)


def test_gspo_token_gradient_is_the_gspo_sequence_gradient():
    # The sequence-level objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) with s_i built with
    # autograd must give the gradient of the GSPO-token form with seq_mean_token_mean.
    generator = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 1, 4, 2])
    behaviour = -torch.rand(10, generator=generator) - 0.5
    pi = (behaviour + 0.3 * torch.randn(10, generator=generator)).requires_grad_()
    sequence_advantages = torch.tensor([1.0, -0.7, 0.4, -1.5])
    advantages = sequence_advantages.repeat_interleave(lens)
    loss_fn = GRPOLoss(ratio_level="sequence", aggregation="seq_mean_token_mean", epsilon_low=0.1)
    loss_fn.compute_loss_from_logprobs(
        pi, None, advantages, behaviour, response_lens=lens
    ).loss.backward()

    reference_pi = pi.detach().clone().requires_grad_()
    objective = []
    for gap, advantage in zip(
        torch.split(reference_pi - behaviour, lens.tolist()), sequence_advantages
    ):
        s = torch.exp(gap.mean())
        objective.append(torch.minimum(s * advantage, s.clamp(0.9, 1.2) * advantage))
    (-torch.stack(objective).mean()).backward()
    torch.testing.assert_close(pi.grad, reference_pi.grad, rtol=1e-5, atol=1e-7)


def test_gspo_with_tis_takes_the_sequence_ratio_against_pi_old():
    pi, old, behaviour, advantages = _tis_case()
    loss_fn = GRPOLoss(ratio_level="sequence", tis_cap=TIS_CAP)
    stats = loss_fn.compute_loss_from_logprobs(
        pi,
        None,
        advantages,
        behaviour,
        old_logprobs=old,
        response_lens=torch.tensor(RESPONSE_LENS),
    )
    # s = exp(mean(log 1.1, log 1.5)) = sqrt(1.65) and exp(mean(log 0.9, log 1.0)) = sqrt(0.9).
    s0, s1 = math.sqrt(1.65), math.sqrt(0.9)
    assert stats.ratios.item() == pytest.approx((s0 + s1) / 2, abs=1e-6)
    # Sequence 0 (A = 1) is clipped to 1.2; sequence 1 is inside the band. Token weights
    # [2, 0.5, 2, 1.5]: (-(2 + 0.5) * 1.2 + 2 * s1 - 1.5 * 2 * s1) / 4.
    expected = (-2.5 * 1.2 + 2.0 * s1 - 3.0 * s1) / 4
    assert stats.policy_loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.clipfrac.item() == 0.5


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"tis_cap": -1.0}, "tis_cap"),
        ({"tis_cap": "2"}, "tis_cap"),
        ({"tis_cap": True}, "tis_cap"),
        ({"tis_cap": math.inf}, "tis_cap"),
        ({"tis_level": "seq"}, "tis_level"),
        ({"ratio_level": "tokens"}, "ratio_level"),
    ],
)
def test_bad_off_policy_values_raise_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key) as error:
        GRPOLoss(**kwargs)
    if key != "tis_cap":
        assert "must be one of token, sequence" in str(error.value)


@pytest.mark.parametrize(
    "kwargs,needed_by",
    [
        ({"ratio_level": "sequence"}, "ratio_level"),
        ({"tis_cap": 2.0, "tis_level": "sequence"}, "correction_level"),
        ({"correction": "mis", "correction_level": "sequence"}, "correction_level"),
    ],
)
def test_sequence_levels_need_response_lens(kwargs, needed_by):
    pi, old, behaviour, advantages = _tis_case()
    loss_fn = GRPOLoss(**kwargs)
    with pytest.raises(ValueError, match=f"response_lens is required when {needed_by}"):
        loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour, old_logprobs=old)
    with pytest.raises(ValueError, match="response_lens must be 1-D and sum"):
        loss_fn.compute_loss_from_logprobs(
            pi, None, advantages, behaviour, response_lens=torch.tensor([2, 1])
        )
    with pytest.raises(ValueError, match="old_logprobs"):
        loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour, old_logprobs=old[:3])


# ---- MIS and IcePop --------------------------------------------------------------------------

# Five sequences; the mismatch log-ratios log r = pi_old - mu are drawn wide enough that every
# band below has tokens (and, at sequence level, sequences) on both sides of it.
MASK_LENS = [3, 5, 2, 4, 6]


def _mask_case(seed=0):
    """pi, pi_old, mu and advantages in float64, pi two PPO-sized steps away from pi_old."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(MASK_LENS)
    behaviour = -torch.rand(num_tokens, generator=generator, dtype=torch.float64) * 3 - 0.1
    old = behaviour + 1.2 * torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    pi = old + 0.15 * torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    sequence_advantages = torch.randn(len(MASK_LENS), generator=generator, dtype=torch.float64)
    advantages = sequence_advantages.repeat_interleave(torch.tensor(MASK_LENS))
    return pi, old, behaviour, advantages


def _reference(pi, old, behaviour, advantages, correction, level, low, cap, eps=0.2):
    """The loss of the published formulas, one token at a time, and which tokens it masks.

    TIS: w = min(max(r, low), cap). MIS (TRL's token_mask / sequence_mask) and IcePop (Ring-1T's
    M(k) = k on [alpha, beta], else 0): w = r inside [low, cap], 0 outside. r = exp(pi_old - mu)
    per token, or exp of the sum over the sequence at sequence level. The policy term is
    -w * min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) with rho = exp(pi - pi_old), averaged
    over every token (masked ones included).
    """
    total, masked_tokens, masked_sequences, start = 0.0, [], 0, 0
    for length in MASK_LENS:
        tokens = range(start, start + length)
        sequence_log_r = sum(float(old[t] - behaviour[t]) for t in tokens)
        sequence_masked = False
        for t in tokens:
            r = math.exp(sequence_log_r if level == "sequence" else float(old[t] - behaviour[t]))
            if correction == "tis":
                w = min(max(r, low or 0.0), cap)
            elif (low is not None and r < low) or r > cap:
                w = 0.0
                masked_tokens.append(t)
                sequence_masked = True
            else:
                w = r
            rho = torch.exp(pi[t] - old[t])
            total = total - w * torch.minimum(
                rho * advantages[t], rho.clamp(1 - eps, 1 + eps) * advantages[t]
            )
        masked_sequences += sequence_masked and level == "sequence"
        start += length
    return total / sum(MASK_LENS), masked_tokens, masked_sequences


@pytest.mark.parametrize(
    "options,low,cap",
    [
        ({"correction": "mis"}, None, 2.0),
        ({"correction": "mis", "correction_level": "sequence"}, None, 2.0),
        ({"correction": "mis", "correction_low": 0.4, "correction_cap": 3.0}, 0.4, 3.0),
        (
            {"correction": "mis", "correction_level": "sequence", "correction_low": 0.25},
            0.25,
            2.0,
        ),
        ({"correction": "icepop"}, 0.5, 5.0),
        ({"correction": "icepop", "correction_low": 0.7, "correction_cap": 1.5}, 0.7, 1.5),
        ({"correction": "tis", "correction_level": "sequence"}, None, 2.0),
        ({"correction": "tis", "correction_low": 0.5, "correction_cap": 1.5}, 0.5, 1.5),
    ],
    ids=["mis", "mis_seq", "mis_band", "mis_seq_band", "icepop", "icepop_band", "tis_seq", "tis"],
)
def test_corrections_match_the_published_formulas(options, low, cap):
    pi, old, behaviour, advantages = _mask_case()
    level = options.get("correction_level", "token")
    lens = torch.tensor(MASK_LENS)
    # No ratio within float32 rounding of a bound, so both sides decide every mask alike.
    log_r = (old - behaviour).tolist()
    if level == "sequence":
        log_r = [sum(part) for part in torch.split(old - behaviour, MASK_LENS)]
    for bound in (low, cap):
        if bound:
            assert min(abs(value - math.log(bound)) for value in log_r) > 1e-4

    reference_pi = pi.clone().requires_grad_()
    expected, masked, masked_sequences = _reference(
        reference_pi, old, behaviour, advantages, options["correction"], level, low, cap
    )
    expected.backward()

    loss_fn = GRPOLoss(**options)
    assert (loss_fn.correction_low, loss_fn.correction_cap) == (low, cap)
    test_pi = pi.clone().requires_grad_()
    stats = loss_fn.compute_loss_from_logprobs(
        test_pi, None, advantages, behaviour, old_logprobs=old, response_lens=lens
    )
    stats.loss.backward()

    assert stats.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(test_pi.grad, reference_pi.grad, rtol=0, atol=1e-6)
    # The metrics count what the formula masked: tokens, and sequences masked whole.
    assert stats.metadata["masked_tokens"].item() == len(masked)
    assert stats.metadata["masked_sequences"].item() == masked_sequences
    if options["correction"] == "tis":
        assert masked == []
    else:
        assert 0 < len(masked) < sum(MASK_LENS)  # the case tests both sides of the band
        assert test_pi.grad[masked].eq(0).all()  # exactly zero, not small
        assert level == "token" or 0 < masked_sequences < len(MASK_LENS)


def test_masked_tokens_get_exactly_zero_gradient_whatever_their_ratio():
    # A token vLLM all but ruled out (log r = 40: r overflows float32) or made certain
    # (log r = -40) is masked: its gradient is exactly 0 and the loss stays finite, while
    # the tokens in the band keep theirs.
    behaviour = _tensor([-1.0, -41.0, -0.5, -0.2])
    old = _tensor([-1.2, -1.0, -40.5, -0.3])
    pi = (old + _tensor([0.05, 0.0, 0.0, -0.05])).requires_grad_()
    advantages = _tensor([1.0, 1.0, -1.0, -1.0])
    stats = GRPOLoss(correction="icepop").compute_loss_from_logprobs(
        pi, None, advantages, behaviour, old_logprobs=old
    )
    stats.loss.backward()
    assert math.isfinite(stats.loss.item())
    assert pi.grad[[1, 2]].tolist() == [0.0, 0.0]
    assert pi.grad[[0, 3]].ne(0).all()
    assert stats.metadata["masked_tokens"].item() == 2


def test_masked_counts_add_up_over_micro_batches():
    pi, old, behaviour, advantages = _mask_case()
    loss_fn = GRPOLoss(correction="mis", correction_level="sequence")
    whole = loss_fn.compute_loss_from_logprobs(
        pi, None, advantages, behaviour, old_logprobs=old, response_lens=torch.tensor(MASK_LENS)
    )
    split = sum(MASK_LENS[:2])  # whole sequences per micro-batch, as packs hold them
    parts = [
        loss_fn.compute_loss_from_logprobs(
            pi[part],
            None,
            advantages[part],
            behaviour[part],
            old_logprobs=old[part],
            response_lens=torch.tensor(lens),
        )
        for part, lens in ((slice(0, split), MASK_LENS[:2]), (slice(split, None), MASK_LENS[2:]))
    ]
    combined = combine_stats(parts)
    for name in ("masked_tokens", "masked_sequences"):
        assert combined.metadata[name].item() == whole.metadata[name].item() > 0, name
