"""The GRPO loss on packed batches.

`GRPOLoss.compute_loss_from_logprobs` takes the flat per-token response logprobs of a pack
(aligned with ``PackedTrajectory.targets``) and returns the clipped surrogate plus a KL penalty
to the reference:

    ratio_t   = exp(pi_t - behaviour_t)            (against pi_old under a correction)
    policy_t  = -w_t * min(ratio_t * A_t, clamp(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    loss      = aggregate(policy) + kl_coeff * aggregate(kl)

``w_t`` is 1, or the detached weight of a sampler/trainer mismatch ``correction`` (TIS, MIS,
IcePop; per token or per sequence). ``ratio_level: sequence`` is GSPO's sequence ratio. Each
aggregation is a weighted token sum over a normaliser, so passing the whole batch's
`batch_loss_normalizer` to every micro-batch makes gradient accumulation exact. The formulas,
their sources and defaults are in docs/training.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pydantic import ValidationError

from grpo.choices import AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, LEVELS
from grpo.config.sections import LossArgs, correction_bounds
from grpo.config.validation import pydantic_problems
from grpo.types import GRPOStats, count_per_sequence

TIS_LEVELS = RATIO_LEVELS = CORRECTION_LEVELS = LEVELS
__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "CORRECTION_LEVELS",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "TIS_LEVELS",
    "GRPOLoss",
    "combine_stats",
]

# exp() overflows fp32 above ~88, and an inf in the unselected clip branch turns its zero
# gradient into NaN (0 * inf); log-ratios are clamped to +-20 before exp (as in verl).
_MAX_LOG_RATIO = 20.0
_DEFAULT = LossArgs()


def _checked_response_lens(
    response_lens: torch.Tensor | Sequence[int] | None,
    num_tokens: int,
    device: torch.device,
    needed_by: str,
) -> torch.Tensor:
    """``response_lens`` as a long tensor; ValueError if missing, not 1-D or not summing to T."""
    if response_lens is None:
        raise ValueError(f"response_lens is required when {needed_by}")
    response_lens = torch.as_tensor(response_lens, device=device).long()
    if response_lens.dim() != 1 or int(response_lens.sum()) != num_tokens:
        raise ValueError(
            f"response_lens must be 1-D and sum to the {num_tokens} response tokens, got "
            f"shape {tuple(response_lens.shape)} summing to {int(response_lens.sum())}"
        )
    return response_lens


def _sequence_index(response_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The sequence of each flat token: ``[0, 0, 1, 1, 1, ...]`` for lens ``[2, 3, ...]``."""
    return torch.arange(response_lens.numel(), device=response_lens.device).repeat_interleave(
        response_lens, output_size=num_tokens
    )


def _sequence_sums(values: torch.Tensor, index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum of the flat per-token ``values`` over each sequence's tokens, ``[N]``."""
    sums = torch.zeros(num_sequences, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, index.to(values.device), values)


def _per_sequence_sum(values: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """`_sequence_sums` repeated on each of the sequence's tokens, ``[T]``."""
    index = _sequence_index(response_lens, values.numel())
    return _sequence_sums(values, index, response_lens.numel())[index]


class GRPOLoss:
    """GRPO / PPO clipped surrogate with a KL penalty to a reference, on packed batches.

    The arguments are the fields of `grpo.config.sections.LossArgs`, with its defaults and
    bounds (docs/config.md lists them; docs/training.md explains each).

    Raises:
        ValueError: If a value is out of range, naming the key and what is allowed (the same
            refusal as ``grpo validate``).
    """

    def __init__(
        self,
        epsilon_low: float = _DEFAULT.epsilon_low,
        epsilon_high: float = _DEFAULT.epsilon_high,
        kl_coeff: float = _DEFAULT.kl_coeff,
        kl_estimator: str = _DEFAULT.kl_estimator,
        aggregation: str = _DEFAULT.aggregation,
        max_response_len: int | None = _DEFAULT.max_response_len,
        correction: str = _DEFAULT.correction,
        correction_level: str = _DEFAULT.correction_level,
        correction_cap: float | None = _DEFAULT.correction_cap,
        correction_low: float | None = _DEFAULT.correction_low,
        tis_cap: float | None = _DEFAULT.tis_cap,
        tis_level: str = _DEFAULT.tis_level,
        ratio_level: str = _DEFAULT.ratio_level,
    ) -> None:
        arguments = {
            "epsilon_low": epsilon_low,
            "epsilon_high": epsilon_high,
            "kl_coeff": kl_coeff,
            "kl_estimator": kl_estimator,
            "aggregation": aggregation,
            "max_response_len": max_response_len,
            "correction": correction,
            "correction_level": correction_level,
            "correction_cap": correction_cap,
            "correction_low": correction_low,
            "tis_cap": tis_cap,
            "tis_level": tis_level,
            "ratio_level": ratio_level,
        }
        try:
            LossArgs.model_validate(arguments)
        except ValidationError as exc:
            raise ValueError("; ".join(pydantic_problems(exc, LossArgs))) from None
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.kl_coeff = float(kl_coeff)
        self.kl_estimator = kl_estimator
        self.aggregation = aggregation
        self.max_response_len = max_response_len
        if tis_cap is not None:  # the older spelling of correction="tis"
            correction, correction_level, correction_cap = "tis", tis_level, tis_cap
        self.correction = correction
        self.correction_level = correction_level
        low, cap = correction_bounds(correction, correction_low, correction_cap)
        self.correction_low = None if low is None else float(low)
        self.correction_cap = None if cap is None else float(cap)
        self.ratio_level = ratio_level

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}("
            f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}, "
            f"kl_coeff={self.kl_coeff}, kl_estimator={self.kl_estimator!r}, "
            f"aggregation={self.aggregation!r}, "
            f"max_response_len={self.max_response_len}, correction={self.correction!r}, "
            f"correction_level={self.correction_level!r}, "
            f"correction_cap={self.correction_cap}, correction_low={self.correction_low}, "
            f"ratio_level={self.ratio_level!r})"
        )

    def batch_loss_normalizer(self, response_lens: torch.Tensor | Sequence[int]) -> int:
        """The count a whole batch's loss is divided by, for gradient accumulation.

        Args:
            response_lens: Trained tokens of EVERY sequence of the batch, across all its
                micro-batches.

        Returns:
            int: Tokens (``token_mean``) or sequences (``seq_*``); pass it as
            ``loss_normalizer`` to every micro-batch.
        """
        lens = torch.as_tensor(response_lens)
        if self.aggregation == "token_mean":
            return int(lens.sum())
        return lens.numel()

    def _token_weights(
        self, num_tokens: int, response_lens: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor | None, int]:
        """Per-token weights (None: all 1) and the local normaliser count of the aggregation."""
        if self.aggregation == "token_mean":
            return None, num_tokens
        response_lens = _checked_response_lens(
            response_lens, num_tokens, device, f"aggregation={self.aggregation!r}"
        )
        num_sequences = response_lens.numel()
        if self.aggregation == "seq_mean_token_mean":
            per_sequence = 1.0 / response_lens.clamp(min=1).float()
        else:
            per_sequence = torch.full_like(
                response_lens, 1.0 / self.max_response_len, dtype=torch.float32
            )
        weights = per_sequence.repeat_interleave(response_lens, output_size=num_tokens)
        return weights, num_sequences

    def _kl(self, pi_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3)."""
        log_ratio = ref_logprobs - pi_logprobs
        if self.kl_estimator == "k1":
            return -log_ratio
        if self.kl_estimator == "k2":
            return 0.5 * log_ratio.square()
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(log_ratio) - log_ratio - 1.0

    def compute_loss_from_logprobs(
        self,
        pi_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        behavior_logprobs: torch.Tensor | None = None,
        *,
        old_logprobs: torch.Tensor | None = None,
        response_lens: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        loss_normalizer: float | int | torch.Tensor | None = None,
        return_pi_logprobs: bool = False,
    ) -> GRPOStats:
        """The GRPO loss from flat per-token logprobs.

        Args:
            pi_logprobs: Current policy logprobs ``[T]`` (carries the graph).
            ref_logprobs: Reference logprobs ``[T]``; may be None only when ``kl_coeff == 0``.
            behavior_logprobs: Logprobs of the sampler (mu) ``[T]``; None: on-policy.
            old_logprobs: The trainer's pre-update logprobs (pi_old) ``[T]``: the ratio's
                reference under a correction. None: first pass, pi_old is ``pi_logprobs``.
            response_lens: Tokens per sequence ``[N]`` summing to ``T``; required by the
                ``seq_*`` aggregations and by sequence-level ratio or correction.
            loss_mask: Bool ``[T]``, True on the tokens to train; the loss and every metric
                are then those of the True tokens alone, the others get zero gradient.
            loss_normalizer: The whole batch's `batch_loss_normalizer` when accumulating over
                micro-batches; None normalises within this call.
            return_pi_logprobs: Put detached ``pi_logprobs`` in ``metadata``.

        Returns:
            GRPOStats: ``loss`` (with graph), ``policy_loss``, ``kl_loss`` and token means of
            ``ratios``, ``clipfrac``, ``approx_policy_kls``. ``metadata`` holds the counts
            `combine_stats` needs, ``kl_to_ref``, the mismatch metrics (``mismatch_kl``,
            ``mismatch_max_abs``: pi_old against mu), ``masked_tokens``,
            ``masked_sequences`` and optionally ``pi_logprobs``.

        Raises:
            ValueError: On mismatched shapes or missing inputs.
        """
        num_tokens = pi_logprobs.numel()
        if pi_logprobs.dim() != 1:
            raise ValueError(f"pi_logprobs must be 1-D [T], got {tuple(pi_logprobs.shape)}")
        for name, value in (
            ("ref_logprobs", ref_logprobs),
            ("advantages", advantages),
            ("behavior_logprobs", behavior_logprobs),
            ("old_logprobs", old_logprobs),
        ):
            if value is not None and tuple(value.shape) != (num_tokens,):
                raise ValueError(
                    f"{name} must have shape ({num_tokens},) like pi_logprobs, got "
                    f"{tuple(value.shape)}"
                )
        if ref_logprobs is None and self.kl_coeff > 0:
            raise ValueError(f"ref_logprobs is required when kl_coeff={self.kl_coeff} > 0")

        device = pi_logprobs.device
        all_pi_logprobs = pi_logprobs
        if loss_mask is not None:
            if tuple(loss_mask.shape) != (num_tokens,):
                raise ValueError(
                    f"loss_mask must have shape ({num_tokens},) like pi_logprobs, got "
                    f"{tuple(loss_mask.shape)}"
                )
            # Selecting first makes every term below exactly that of the trained tokens alone.
            keep = loss_mask.to(device).bool()
            if response_lens is not None:
                lens = _checked_response_lens(response_lens, num_tokens, device, "")
                response_lens = count_per_sequence(keep, lens)
            pi_logprobs = pi_logprobs[keep]
            ref_logprobs = None if ref_logprobs is None else ref_logprobs.to(device)[keep]
            advantages = advantages.to(device)[keep]
            if behavior_logprobs is not None:
                behavior_logprobs = behavior_logprobs.to(device)[keep]
            if old_logprobs is not None:
                old_logprobs = old_logprobs.to(device)[keep]
            num_tokens = pi_logprobs.numel()
        pi_logprobs = pi_logprobs.float()
        # Inputs computed elsewhere are constants of the loss: never let gradient reach them.
        advantages = advantages.detach().to(device, torch.float32)
        if old_logprobs is None:
            old_logprobs = pi_logprobs.detach()
        else:
            old_logprobs = old_logprobs.detach().to(device, torch.float32)
        if behavior_logprobs is None:
            behavior_logprobs = old_logprobs
        else:
            behavior_logprobs = behavior_logprobs.detach().to(device, torch.float32)
        if ref_logprobs is not None:
            ref_logprobs = ref_logprobs.detach().to(device, torch.float32)

        weights, normalizer_count = self._token_weights(num_tokens, response_lens, device)
        if loss_normalizer is None:
            normalizer = float(max(normalizer_count, 1))
        else:
            normalizer = float(loss_normalizer)
            if not normalizer > 0:
                raise ValueError(f"loss_normalizer must be > 0, got {loss_normalizer!r}")

        def aggregate(per_token: torch.Tensor) -> torch.Tensor:
            if weights is not None:
                per_token = per_token * weights
            return per_token.sum() / normalizer

        # Under a correction the ratio measures only this update; the weight handles mismatch.
        corrects = self.correction != "none"
        ratio_reference = old_logprobs if corrects else behavior_logprobs
        if self.ratio_level == "token":
            log_ratio = (pi_logprobs - ratio_reference).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            ratio = torch.exp(log_ratio)
        else:
            lens = _checked_response_lens(
                response_lens, num_tokens, device, "ratio_level='sequence'"
            )
            gap_sums = _per_sequence_sum(pi_logprobs.detach() - ratio_reference, lens)
            token_lens = lens.clamp(min=1).repeat_interleave(lens, output_size=num_tokens)
            log_sequence_ratio = (gap_sums / token_lens).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            # GSPO-token: exp(pi - sg(pi)) is 1 in value and turns s_i's gradient into s_i*grad pi.
            ratio = torch.exp(log_sequence_ratio) * torch.exp(pi_logprobs - pi_logprobs.detach())
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high) * advantages
        # The same mask as min(), so clipfrac counts the tokens whose gradient the clip removed.
        is_clipped = clipped < unclipped
        per_token_policy = -torch.where(is_clipped, clipped, unclipped)
        masked_tokens = masked_sequences = torch.zeros((), device=device)
        if corrects:
            correction_weights, masked_tokens, masked_sequences = self._correction_weights(
                old_logprobs, behavior_logprobs, response_lens, device
            )
            per_token_policy = per_token_policy * correction_weights
        policy_loss = aggregate(per_token_policy)

        if ref_logprobs is not None:
            kl = self._kl(pi_logprobs, ref_logprobs)
            kl_to_ref = kl.detach().sum() / max(num_tokens, 1)
        else:
            kl = None
            kl_to_ref = torch.zeros((), device=device)
        if self.kl_coeff > 0:
            kl_loss = self.kl_coeff * aggregate(kl)
        else:
            # Not 0 * kl: an inf estimate would turn into NaN.
            kl_loss = torch.zeros((), device=device)
        loss = policy_loss + kl_loss

        with torch.no_grad():
            token_count = max(num_tokens, 1)
            behaviour_gap = pi_logprobs.detach() - behavior_logprobs
            mismatch = old_logprobs - behavior_logprobs
            log_r = mismatch.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            metadata = {
                "num_tokens": num_tokens,
                "num_sequences": (
                    int(torch.as_tensor(response_lens).numel())
                    if response_lens is not None
                    else None
                ),
                "loss_normalizer": normalizer,
                "normalizer_count": normalizer_count,
                "kl_to_ref": kl_to_ref,
                "mismatch_kl": (torch.exp(log_r) - 1.0 - log_r).sum() / token_count,
                "mismatch_max_abs": (
                    mismatch.abs().max() if num_tokens else torch.zeros((), device=device)
                ),
                "masked_tokens": masked_tokens,
                "masked_sequences": masked_sequences,
            }
            if return_pi_logprobs:
                metadata["pi_logprobs"] = all_pi_logprobs.detach().float()
            return GRPOStats(
                loss=loss,
                policy_loss=policy_loss,
                kl_loss=kl_loss,
                ratios=ratio.detach().sum() / token_count,
                clipfrac=is_clipped.float().sum() / token_count,
                approx_policy_kls=(0.5 * behaviour_gap.square()).sum() / token_count,
                metadata=metadata,
            )

    def _correction_weights(
        self,
        old_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        response_lens: torch.Tensor | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Detached correction weights ``[T]``, masked token count, masked sequence count."""
        log_ratio = old_logprobs - behavior_logprobs
        num_tokens = log_ratio.numel()
        sequence_level = self.correction_level == "sequence"
        if sequence_level:
            lens = _checked_response_lens(
                response_lens, num_tokens, device, "correction_level='sequence'"
            )
            index = _sequence_index(lens, num_tokens)
            sequence_log_ratio = _sequence_sums(log_ratio, index, lens.numel())
            log_ratio = sequence_log_ratio[index]
        # Upper clamp only: overflow to inf would break the cap; underflow to 0 is harmless.
        ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
        zero = torch.zeros((), device=device)
        if self.correction == "tis":
            return ratio.clamp(min=self.correction_low, max=self.correction_cap), zero, zero

        def outside(log_values: torch.Tensor) -> torch.Tensor:
            # Compared in log space: exact for ratios that exp() would overflow or underflow.
            out = log_values > math.log(self.correction_cap)
            if self.correction_low:  # a lower bound of 0 masks nothing
                out |= log_values < math.log(self.correction_low)
            return out

        masked = outside(log_ratio)
        masked_sequences = outside(sequence_log_ratio).sum().float() if sequence_level else zero
        # where(), not a 0/1 product: a masked weight is exactly 0 even if the ratio is inf.
        weights = torch.where(masked, torch.zeros_like(ratio), ratio)
        return weights, masked.sum().float(), masked_sequences


def combine_stats(stats: Sequence[GRPOStats]) -> GRPOStats:
    """Exact whole-batch stats from the stats of its micro-batches (detached, for logging).

    Token means are weighted by each call's ``num_tokens``, counts summed, maxima maxed; loss
    parts are exact whether the calls shared the batch normaliser or each used its own.

    Returns:
        GRPOStats: Combined stats; ``metadata`` holds the summed counts.

    Raises:
        ValueError: If ``stats`` is empty or lacks the counts in ``metadata``.
    """
    if not stats:
        raise ValueError("combine_stats: stats is empty")
    for index, item in enumerate(stats):
        if not item.metadata or "num_tokens" not in item.metadata:
            raise ValueError(f"combine_stats: stats[{index}] has no num_tokens in metadata")
    num_tokens = sum(item.metadata["num_tokens"] for item in stats)
    normalizer_count = sum(item.metadata["normalizer_count"] for item in stats)

    def loss_part(name: str) -> torch.Tensor:
        total = sum(
            getattr(item, name).detach() * item.metadata["loss_normalizer"] for item in stats
        )
        return total / max(normalizer_count, 1)

    def token_mean(getter) -> torch.Tensor:
        total = sum(getter(item).detach() * item.metadata["num_tokens"] for item in stats)
        return total / max(num_tokens, 1)

    num_sequences = [item.metadata.get("num_sequences") for item in stats]
    return GRPOStats(
        loss=loss_part("loss"),
        policy_loss=loss_part("policy_loss"),
        kl_loss=loss_part("kl_loss"),
        ratios=token_mean(lambda item: item.ratios),
        clipfrac=token_mean(lambda item: item.clipfrac),
        approx_policy_kls=token_mean(lambda item: item.approx_policy_kls),
        metadata={
            "num_tokens": num_tokens,
            "num_sequences": None if None in num_sequences else sum(num_sequences),
            "normalizer_count": normalizer_count,
            "kl_to_ref": token_mean(lambda item: item.metadata["kl_to_ref"]),
            "mismatch_kl": token_mean(lambda item: item.metadata["mismatch_kl"]),
            "mismatch_max_abs": torch.stack(
                [item.metadata["mismatch_max_abs"].detach().float() for item in stats]
            ).max(),
            "masked_tokens": sum(item.metadata["masked_tokens"].detach() for item in stats),
            "masked_sequences": sum(item.metadata["masked_sequences"].detach() for item in stats),
        },
    )
