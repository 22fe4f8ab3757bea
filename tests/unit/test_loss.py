"""Tests of the GRPO loss and of the chunked hidden-state -> logprob path."""

import math

import pytest
import torch
from torchtune.models.qwen2 import qwen2

from grpo.objective.loss import AGGREGATIONS, GRPOLoss, combine_stats
from grpo.packing.logprobs import (
    model_hidden_states,
    model_response_logprobs,
    output_projection_weight,
    response_logprobs_from_hidden,
    target_logprobs_from_hidden,
)
from grpo.types import PackedTrajectory
from tests.helpers.logprobs import response_logprobs_from_logits

# A hand-checked case, eps_low = eps_high = 0.2. Per token: ratio r = exp(pi - behaviour),
# advantage A, and the policy loss -min(r*A, clamp(r, 0.8, 1.2)*A) worked out by hand.
RATIOS = [1.5, 0.5, 1.1, 0.9, 1.0, 1.5, 0.5]
ADVANTAGES = [1.0, -1.0, 2.0, -0.5, 0.0, -1.0, 1.0]
EXPECTED_POLICY = [
    -1.2,  # r above 1.2 and A > 0: clipped to 1.2 * 1
    0.8,  # r below 0.8 and A < 0: clipped to 0.8 * -1, loss +0.8
    -2.2,  # inside the band: 1.1 * 2
    0.45,  # inside the band: 0.9 * -0.5
    0.0,  # A = 0
    1.5,  # r above the band but A < 0: the unclipped -1.5 is smaller
    -0.5,  # r below the band but A > 0: the unclipped 0.5 is smaller
]
EXPECTED_CLIPPED = 2
BEHAVIOUR = [-1.0, -2.0, -0.5, -1.5, -0.7, -3.0, -0.2]
REF_MINUS_PI = [0.5, -0.3, 0.0, 1.0, -1.0, 0.2, 0.1]
RESPONSE_LENS = [3, 4]
MAX_RESPONSE_LEN = 8


# A demo run in the shipped config's output_dir must not make validation refuse it.
FRESH = "overwrite_output_dir=true"


def _hand_case():
    pi = [b + math.log(r) for b, r in zip(BEHAVIOUR, RATIOS)]
    ref = [p + d for p, d in zip(pi, REF_MINUS_PI)]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    return as_tensor(pi), as_tensor(ref), as_tensor(ADVANTAGES), as_tensor(BEHAVIOUR)


def _hand_kl(estimator):
    if estimator == "k1":
        return [-d for d in REF_MINUS_PI]
    if estimator == "k2":
        return [0.5 * d * d for d in REF_MINUS_PI]
    return [math.exp(d) - d - 1 for d in REF_MINUS_PI]


def _hand_aggregate(values, aggregation):
    if aggregation == "token_mean":
        return sum(values) / len(values)
    first, second = values[:3], values[3:]
    if aggregation == "seq_mean_token_mean":
        return (sum(first) / 3 + sum(second) / 4) / 2
    return (sum(first) / MAX_RESPONSE_LEN + sum(second) / MAX_RESPONSE_LEN) / 2


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_matches_hand_computation(estimator, aggregation):
    # k1 has no gradient to regularise with (refused beside kl_coeff > 0): only its estimate,
    # kl_to_ref, is checked.
    kl_coeff = 0.0 if estimator == "k1" else 0.1
    loss_fn = GRPOLoss(
        kl_coeff=kl_coeff,
        kl_estimator=estimator,
        aggregation=aggregation,
        max_response_len=MAX_RESPONSE_LEN,
    )
    pi, ref, advantages, behaviour = _hand_case()
    stats = loss_fn.compute_loss_from_logprobs(
        pi, ref, advantages, behaviour, response_lens=torch.tensor(RESPONSE_LENS)
    )
    expected_policy = _hand_aggregate(EXPECTED_POLICY, aggregation)
    expected_kl = kl_coeff * _hand_aggregate(_hand_kl(estimator), aggregation)
    assert stats.policy_loss.item() == pytest.approx(expected_policy, abs=1e-6)
    assert stats.kl_loss.item() == pytest.approx(expected_kl, abs=1e-6)
    assert stats.loss.item() == pytest.approx(expected_policy + expected_kl, abs=1e-6)
    assert stats.ratios.item() == pytest.approx(sum(RATIOS) / 7, abs=1e-6)
    assert stats.clipfrac.item() == pytest.approx(EXPECTED_CLIPPED / 7)
    expected_approx_kl = sum(0.5 * math.log(r) ** 2 for r in RATIOS) / 7
    assert stats.approx_policy_kls.item() == pytest.approx(expected_approx_kl, abs=1e-6)
    expected_kl_to_ref = sum(_hand_kl(estimator)) / 7
    assert stats.metadata["kl_to_ref"].item() == pytest.approx(expected_kl_to_ref, abs=1e-6)
    assert stats.metadata["num_tokens"] == 7
    assert stats.metadata["num_sequences"] == 2


def test_default_kl_coeff_is_zero_and_ref_is_optional():
    loss_fn = GRPOLoss()
    pi, _, advantages, behaviour = _hand_case()
    stats = loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour)
    assert stats.kl_loss.item() == 0.0
    assert stats.loss.item() == pytest.approx(sum(EXPECTED_POLICY) / 7, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOLoss(kl_coeff=0.1).compute_loss_from_logprobs(pi, None, advantages, behaviour)


def test_clipfrac_counts_exactly_the_clipped_tokens():
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28)
    cases = [  # (ratio, advantage, clipped?)
        (1.35, 1.0, True),  # above 1 + eps_high, A > 0
        (1.25, 1.0, False),  # above 1 + eps_low but inside the clip-higher band
        (0.7, -2.0, True),  # below 1 - eps_low, A < 0
        (0.85, -2.0, False),  # inside the band, A < 0
        (1.35, -1.0, False),  # above the band, A < 0: unclipped term is the minimum
        (0.7, 1.0, False),  # below the band, A > 0: unclipped term is the minimum
        (1.35, 0.0, False),  # A = 0: both terms are 0
        (0.5, -0.5, True),
    ]
    ratio = torch.tensor([case[0] for case in cases])
    advantages = torch.tensor([case[1] for case in cases])
    behaviour = torch.linspace(-3.0, -0.5, len(cases))
    pi = (behaviour + ratio.log()).requires_grad_()
    stats = loss_fn.compute_loss_from_logprobs(pi, None, advantages, behaviour)
    clipped = torch.tensor([case[2] for case in cases])
    assert stats.clipfrac.item() == pytest.approx(clipped.float().mean().item())
    stats.loss.backward()
    # A clipped token contributes no gradient; every other token with A != 0 does.
    assert torch.all(pi.grad[clipped] == 0)
    assert torch.all(pi.grad[~clipped & (advantages != 0)] != 0)


def test_no_gradient_reaches_ref_behaviour_or_advantages():
    loss_fn = GRPOLoss(kl_coeff=0.5, kl_estimator="k3")
    pi, ref, advantages, behaviour = _hand_case()
    pi.requires_grad_()
    ref.requires_grad_()
    advantages.requires_grad_()
    behaviour.requires_grad_()
    stats = loss_fn.compute_loss_from_logprobs(pi, ref, advantages, behaviour)
    stats.loss.backward()
    assert pi.grad is not None
    assert ref.grad is None and advantages.grad is None and behaviour.grad is None


def test_gradient_wrt_pi():
    # Ratios inside the band: d/dpi -(r * A) = -A * r; k3 adds beta * (1 - exp(ref - pi)).
    kl_coeff = 0.1
    ratios = [1.1, 0.9, 1.0, 1.05]
    advantages = [1.0, -2.0, 0.5, 3.0]
    ref_minus_pi = [0.3, -0.2, 0.0, 0.1]
    behaviour = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    pi = (behaviour + torch.tensor(ratios).log()).requires_grad_()
    ref = pi.detach() + torch.tensor(ref_minus_pi)
    loss_fn = GRPOLoss(kl_coeff=kl_coeff, kl_estimator="k3")
    loss_fn.compute_loss_from_logprobs(pi, ref, torch.tensor(advantages), behaviour).loss.backward()
    expected = [
        (-a * r + kl_coeff * (1 - math.exp(d))) / 4
        for r, a, d in zip(ratios, advantages, ref_minus_pi)
    ]
    torch.testing.assert_close(pi.grad, torch.tensor(expected), rtol=1e-5, atol=1e-7)


def test_on_policy_ratio_is_one_with_gradient_of_pi():
    pi = torch.tensor([-1.0, -2.0, -0.3]).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 2.0])
    stats = GRPOLoss().compute_loss_from_logprobs(pi, None, advantages)
    assert stats.ratios.item() == 1.0 and stats.clipfrac.item() == 0.0
    assert stats.approx_policy_kls.item() == 0.0
    stats.loss.backward()
    torch.testing.assert_close(pi.grad, -advantages / 3)


def test_extreme_log_ratio_gives_finite_loss_and_gradient():
    behaviour = torch.tensor([-100.0, -0.1, -0.1])
    pi = torch.tensor([-0.1, -100.0, -0.1]).requires_grad_()
    ref = torch.tensor([-0.1, -0.1, -100.0])
    loss_fn = GRPOLoss(kl_coeff=0.1, kl_estimator="k3")
    stats = loss_fn.compute_loss_from_logprobs(pi, ref, torch.tensor([1.0, -1.0, 1.0]), behaviour)
    stats.loss.backward()
    assert torch.isfinite(stats.loss) and torch.all(torch.isfinite(pi.grad))


def test_return_pi_logprobs_is_detached():
    pi, ref, advantages, behaviour = _hand_case()
    pi.requires_grad_()
    stats = GRPOLoss().compute_loss_from_logprobs(
        pi, ref, advantages, behaviour, return_pi_logprobs=True
    )
    assert not stats.metadata["pi_logprobs"].requires_grad
    torch.testing.assert_close(stats.metadata["pi_logprobs"], pi.detach())
    assert (
        "pi_logprobs"
        not in GRPOLoss().compute_loss_from_logprobs(pi, ref, advantages, behaviour).metadata
    )


# ---- chunked logprobs ------------------------------------------------------------------------


def _random_row(length=23, dim=16, vocab=37, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(length, dim, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, dim, generator=generator, dtype=dtype) / dim**0.5
    response_mask = torch.rand(length, generator=generator) < 0.6
    response_mask[0] = False
    targets = torch.randint(0, vocab, (int(response_mask.sum()),), generator=generator)
    return hidden, weight, response_mask, targets


def _full_logprobs(hidden, weight, response_mask, targets):
    return response_logprobs_from_logits(hidden @ weight.t(), response_mask, targets)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_chunked_logprobs_and_gradients_equal_full_log_softmax(dtype, atol):
    hidden, weight, response_mask, targets = _random_row(dtype=dtype)
    num_targets = targets.numel()
    assert num_targets > 8 and (num_targets % 4 or num_targets % 5)  # a chunk size not dividing T
    upstream = torch.randn(num_targets, dtype=dtype)

    hidden_ref = hidden.clone().requires_grad_()
    weight_ref = weight.clone().requires_grad_()
    expected = _full_logprobs(hidden_ref, weight_ref, response_mask, targets)
    (expected * upstream).sum().backward()

    for chunk_size in (1, 4, 5, num_targets, num_targets + 10):
        hidden_test = hidden.clone().requires_grad_()
        weight_test = weight.clone().requires_grad_()
        logprobs = response_logprobs_from_hidden(
            hidden_test[None], weight_test, response_mask, targets, chunk_size=chunk_size
        )
        assert logprobs.dtype == dtype
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=atol)
        (logprobs * upstream).sum().backward()
        torch.testing.assert_close(hidden_test.grad, hidden_ref.grad, rtol=0, atol=atol)
        torch.testing.assert_close(weight_test.grad, weight_ref.grad, rtol=0, atol=atol)


def test_chunked_logprobs_pass_gradcheck():
    hidden, weight, response_mask, targets = _random_row(
        length=9, dim=4, vocab=7, dtype=torch.float64
    )
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: response_logprobs_from_hidden(h, w, response_mask, targets, chunk_size=2),
        (hidden, weight),
    )


def test_tempered_chunked_logprobs_and_gradients_are_those_of_the_divided_logits():
    """The trainer scores the distribution vLLM samples at temperature T: log_softmax of the
    logits divided by T, with its gradient."""
    hidden, weight, response_mask, targets = _random_row(dtype=torch.float64)
    positions = response_mask[1:].nonzero().squeeze(-1)
    upstream = torch.randn(targets.numel(), dtype=torch.float64)
    hidden_ref = hidden.clone().requires_grad_()
    weight_ref = weight.clone().requires_grad_()
    logits = (hidden_ref @ weight_ref.t())[positions] / 0.7
    expected = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    (expected * upstream).sum().backward()

    hidden_test = hidden.clone().requires_grad_()
    weight_test = weight.clone().requires_grad_()
    logprobs = target_logprobs_from_hidden(
        hidden_test, weight_test, positions, targets, chunk_size=4, temperature=0.7
    )
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-12)
    (logprobs * upstream).sum().backward()
    torch.testing.assert_close(hidden_test.grad, hidden_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight_test.grad, weight_ref.grad, rtol=0, atol=1e-12)
    untempered = target_logprobs_from_hidden(hidden, weight, positions, targets)
    assert float((untempered - logprobs.detach()).abs().max()) > 0.1
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        target_logprobs_from_hidden(hidden, weight, positions, targets, temperature=0.0)


def test_chunked_logprobs_frozen_weight_and_empty_response():
    hidden, weight, response_mask, targets = _random_row()
    hidden.requires_grad_()
    response_logprobs_from_hidden(hidden, weight, response_mask, targets, 3).sum().backward()
    assert hidden.grad is not None and weight.grad is None
    empty = response_logprobs_from_hidden(
        hidden, weight, torch.zeros(23, dtype=torch.bool), torch.zeros(0, dtype=torch.long), 3
    )
    assert empty.shape == (0,)


def _saved_bytes(compute):
    """Bytes autograd keeps for backward while running ``compute()``."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute()
    return sum(saved)


def test_chunked_logprobs_keep_no_logits_for_backward():
    num_positions, dim, vocab = 65, 8, 4096
    hidden, weight, response_mask, targets = _random_row(num_positions, dim, vocab)
    hidden.requires_grad_()
    weight.requires_grad_()
    logits_bytes = targets.numel() * vocab * 4
    chunked = _saved_bytes(
        lambda: response_logprobs_from_hidden(hidden, weight, response_mask, targets, 8)
    )
    full = _saved_bytes(lambda: _full_logprobs(hidden, weight, response_mask, targets))
    assert full >= logits_bytes  # the plain path keeps [T, V] logits alive until backward
    # The chunked path keeps its inputs (selected hidden states, weight, ids), no logits.
    assert chunked <= (num_positions * dim + vocab * dim) * 4 + 2 * num_positions * 8
    assert chunked < logits_bytes / 4


def test_chunked_logprobs_reject_misaligned_targets():
    hidden, weight, response_mask, targets = _random_row()
    with pytest.raises(ValueError, match="targets"):
        response_logprobs_from_hidden(hidden, weight, response_mask, targets[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        response_logprobs_from_hidden(hidden, weight, response_mask, targets, chunk_size=0)


# ---- gradient accumulation -------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_normalizer_makes_micro_batches_sum_to_the_batch(aggregation):
    generator = torch.Generator().manual_seed(1)
    response_lens = torch.tensor([3, 1, 4, 0, 2, 5])
    num_tokens = int(response_lens.sum())
    pi = torch.randn(num_tokens, generator=generator) - 2.0
    behaviour = pi + 0.3 * torch.randn(num_tokens, generator=generator)
    ref = pi + 0.2 * torch.randn(num_tokens, generator=generator)
    advantages = torch.randn(response_lens.numel(), generator=generator).repeat_interleave(
        response_lens
    )
    loss_fn = GRPOLoss(
        kl_coeff=0.05, aggregation=aggregation, max_response_len=6, epsilon_high=0.28
    )

    whole_pi = pi.clone().requires_grad_()
    whole = loss_fn.compute_loss_from_logprobs(
        whole_pi, ref, advantages, behaviour, response_lens=response_lens
    )
    whole.loss.backward()

    normalizer = loss_fn.batch_loss_normalizer(response_lens)
    expected_count = num_tokens if aggregation == "token_mean" else 6  # the empty one counts
    assert normalizer == expected_count
    split_pi = pi.clone().requires_grad_()
    sequence_splits = [(0, 2), (2, 4), (4, 6)]
    accumulated, local = [], []
    for first, last in sequence_splits:
        start, end = int(response_lens[:first].sum()), int(response_lens[:last].sum())
        inputs = (split_pi[start:end], ref[start:end], advantages[start:end], behaviour[start:end])
        lens = response_lens[first:last]
        stats = loss_fn.compute_loss_from_logprobs(
            *inputs, response_lens=lens, loss_normalizer=normalizer
        )
        stats.loss.backward()
        accumulated.append(stats)
        local.append(loss_fn.compute_loss_from_logprobs(*inputs, response_lens=lens))

    total = sum(stats.loss for stats in accumulated)
    torch.testing.assert_close(total, whole.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_pi.grad, whole_pi.grad, rtol=1e-6, atol=1e-8)
    # combine_stats recovers the whole-batch numbers from either normalisation.
    for parts in (accumulated, local):
        combined = combine_stats(parts)
        for name in ("loss", "policy_loss", "kl_loss", "ratios", "clipfrac", "approx_policy_kls"):
            torch.testing.assert_close(
                getattr(combined, name), getattr(whole, name).detach(), rtol=1e-6, atol=1e-7
            )
        assert combined.metadata["num_tokens"] == num_tokens


# ---- config validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_low": 1.0}, "epsilon_low"),
        ({"epsilon_high": -0.2}, "epsilon_high"),
        ({"epsilon_high": "0.2"}, "epsilon_high"),
        ({"kl_coeff": -1.0}, "kl_coeff"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"max_response_len": 0}, "max_response_len"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "max_response_len"),
    ],
)
def test_bad_config_values_raise_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GRPOLoss(**kwargs)


def test_bad_inputs_raise():
    loss_fn = GRPOLoss(aggregation="seq_mean_token_mean")
    pi, ref, advantages, behaviour = _hand_case()
    with pytest.raises(ValueError, match="response_lens"):
        loss_fn.compute_loss_from_logprobs(pi, ref, advantages, behaviour)
    with pytest.raises(ValueError, match="response_lens"):
        loss_fn.compute_loss_from_logprobs(
            pi, ref, advantages, behaviour, response_lens=torch.tensor([3, 3])
        )
    with pytest.raises(ValueError, match="advantages"):
        loss_fn.compute_loss_from_logprobs(
            pi, ref, advantages[:3], behaviour, response_lens=torch.tensor([3, 4])
        )
    with pytest.raises(ValueError, match="loss_normalizer"):
        loss_fn.compute_loss_from_logprobs(
            pi, ref, advantages, behaviour, response_lens=torch.tensor([3, 4]), loss_normalizer=0
        )


# Each check of GRPOLoss's constructor, as a value it refuses and the key it names. `grpo
# validate` must refuse every one of them too, before any actor starts.
LOSS_REFUSALS = [
    ({"epsilon_low": -0.1}, "epsilon_low"),
    ({"epsilon_low": 1.5}, "epsilon_low"),
    ({"epsilon_low": True}, "epsilon_low"),
    ({"epsilon_high": -0.2}, "epsilon_high"),
    ({"epsilon_high": "0.2"}, "epsilon_high"),
    ({"kl_coeff": -1.0}, "kl_coeff"),
    ({"kl_coeff": math.nan}, "kl_coeff"),
    ({"kl_coeff": math.inf}, "kl_coeff"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"kl_coeff": 0.04, "kl_estimator": "k1"}, "kl_estimator"),
    ({"aggregation": "sum"}, "aggregation"),
    ({"aggregation": "seq_mean_token_sum_norm"}, "max_response_len"),
    ({"max_response_len": 0}, "max_response_len"),
    ({"max_response_len": 2.5}, "max_response_len"),
    ({"tis_cap": 0.0}, "tis_cap"),
    ({"tis_cap": math.inf}, "tis_cap"),
    ({"tis_cap": True}, "tis_cap"),
    ({"tis_level": "seq"}, "tis_level"),
    ({"ratio_level": "tokens"}, "ratio_level"),
    ({"correction": "is"}, "correction"),
    ({"correction": "icepop", "correction_level": "sequence"}, "correction_level"),
    ({"correction_level": "sequence"}, "correction_level"),
    ({"correction_cap": 2.0}, "correction_cap"),
    ({"correction": "mis", "correction_cap": 0.5}, "correction_cap"),
    ({"correction": "tis", "correction_cap": math.inf}, "correction_cap"),
    ({"correction": "mis", "correction_low": 1.5}, "correction_low"),
    ({"correction": "mis", "correction_low": -0.5}, "correction_low"),
    ({"correction": "mis", "correction_low": 1.0, "correction_cap": 1.0}, "correction_low"),
    ({"correction": "tis", "correction_low": 0.5, "correction_cap": 0.3}, "correction_low"),
    ({"correction_low": 0.5}, "correction_low"),
    ({"correction": "tis", "tis_cap": 2.0}, "tis_cap"),
    ({"correction": "mis", "tis_level": "sequence"}, "tis_level"),
]


def test_the_refusals_cover_every_argument_of_the_loss():
    import inspect

    arguments = set(inspect.signature(GRPOLoss).parameters)
    assert {key for kwargs, _ in LOSS_REFUSALS for key in kwargs} == arguments


@pytest.mark.parametrize("kwargs,key", LOSS_REFUSALS, ids=lambda value: repr(value))
def test_validate_refuses_what_the_loss_refuses(kwargs, key):
    """A value the loss would refuse inside the trainer, after Ray and every actor started, is
    refused by `grpo validate` first, naming the same key."""
    from omegaconf import open_dict

    from grpo.config import compose_config
    from grpo.config.validation import check_config

    with pytest.raises(ValueError, match=key):
        GRPOLoss(**kwargs)
    cfg = compose_config("tiny_arithmetic_cpu")
    assert not check_config(cfg, check_components=False).problems
    with open_dict(cfg):
        for name, value in kwargs.items():
            cfg.training.loss[name] = value
    problems = check_config(cfg, check_components=False).problems
    assert any(problem.startswith(f"training.loss.{key}:") for problem in problems), problems


def test_grpo_validate_refuses_k1_as_a_loss_term_in_one_line(capsys):
    from grpo.cli import main

    overrides = ["training.loss.kl_estimator=k1", "training.loss.kl_coeff=0.04"]
    assert main(["validate", "tiny_arithmetic_cpu", *overrides]) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("grpo validate: error: training.loss.kl_estimator: k1 beside")
    assert "use k3" in lines[0] and "or k2" in lines[0]
    # Without a KL term k1 is only the kl_to_ref estimate: accepted.
    assert main(["validate", "tiny_arithmetic_cpu", "training.loss.kl_estimator=k1", FRESH]) == 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_expected_gradient_of_each_kl_estimator_as_a_loss_term(estimator):
    """On an exact categorical over 6 tokens (the expectation over the samples of pi computed
    exactly, not sampled), the gradient of E_pi[k(x)] taken through log pi(x) with x fixed, as
    the loss takes it: k1's is zero (it regularises nothing), k2's is that of the reverse KL
    KL(pi, ref), k3's that of the forward KL(ref, pi)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=generator, dtype=torch.float64), dim=0)
    log_pi = torch.log_softmax(logits, dim=0)
    pi = log_pi.exp()
    # kl_coeff 0: the estimator alone (k1 is refused beside a KL term).
    estimate = GRPOLoss(kl_estimator=estimator)._kl(log_pi, ref)
    (grad,) = torch.autograd.grad((pi.detach() * estimate).sum(), logits, retain_graph=True)

    reverse = torch.autograd.grad((pi * (log_pi - ref)).sum(), logits, retain_graph=True)[0]
    forward = torch.autograd.grad((ref.exp() * (ref - log_pi)).sum(), logits)[0]
    assert float(reverse.abs().max()) > 0.05 and float((reverse - forward).abs().max()) > 0.05
    if estimator == "k1":
        assert float(grad.abs().max()) < 1e-12
    else:
        expected = reverse if estimator == "k2" else forward
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


# ---- torchtune model path --------------------------------------------------------------------


def _tiny_qwen2(tie_word_embeddings):
    torch.manual_seed(0)
    return qwen2(
        vocab_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
        tie_word_embeddings=tie_word_embeddings,
    )


def _hand_packed(prompt_lens, response_lens, vocab_size=64, seed=0):
    """A pack of two sequences, built directly (block-causal mask, restarting positions)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    total = sum(lengths)
    tokens = torch.randint(0, vocab_size, (total,), generator=generator)
    sequence_mask = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    position_ids = torch.arange(total) - starts[sequence_mask]
    response_mask = position_ids >= torch.tensor(prompt_lens)[sequence_mask]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    attention_mask = causal & (sequence_mask[:, None] == sequence_mask[None, :])
    num_response = sum(response_lens)
    return PackedTrajectory(
        tokens=tokens,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        sequence_mask=sequence_mask,
        prompt_lens=torch.tensor(prompt_lens),
        response_lens=torch.tensor(response_lens),
        sequence_map=torch.stack([starts, starts + torch.tensor(lengths)], dim=1),
        packed_seq_len=total,
        targets=tokens[response_mask],
        ref_logprobs=-torch.rand(num_response, generator=generator) - 1.0,
        advantages=torch.randn(len(lengths), generator=generator).repeat_interleave(
            torch.tensor(response_lens)
        ),
        behavior_logprobs=-torch.rand(num_response, generator=generator) - 3.0,
        actual_total_tokens=total,
    )


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_model_response_logprobs_match_full_logits(tie_word_embeddings):
    model = _tiny_qwen2(tie_word_embeddings)
    packed = _hand_packed([3, 5], [4, 6])
    if tie_word_embeddings:
        assert output_projection_weight(model) is model.tok_embeddings.weight
    else:
        assert output_projection_weight(model) is model.output.weight
    logits = model(
        packed.tokens[None], mask=packed.attention_mask[None], input_pos=packed.position_ids[None]
    )
    expected = response_logprobs_from_logits(logits, packed.response_mask, packed.targets)
    logprobs = model_response_logprobs(model, packed, chunk_size=3)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    # The model is left as it was: a plain forward returns logits again.
    assert model(packed.tokens[None]).shape[-1] == 64
    # The projection module, read as its weight, gives the same logprobs.
    hidden = model_hidden_states(model, packed)
    via_module = response_logprobs_from_hidden(
        hidden,
        output_projection_weight(model.output),
        packed.response_mask,
        packed.targets,
        chunk_size=4,
    )
    torch.testing.assert_close(via_module, expected, rtol=0, atol=1e-5)
