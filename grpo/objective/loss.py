"""The GRPO loss on packed batches.

`GRPOLoss.compute_loss_from_logprobs` works on the flat per-token response
logprobs of a pack, aligned with ``PackedTrajectory.targets``. They come from
`grpo.packing.logprobs.model_response_logprobs`, which projects the response positions' hidden states
to the vocabulary in chunks (the ``[L, V]`` logits are never built); the trainer runs it inside
its FSDP root module's forward, so the output projection is unsharded there:

    ratio_t   = exp(pi_t - behaviour_t)
    policy_t  = -min(ratio_t * A_t, clamp(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    kl_t      = k1 | k2 | k3 estimate of KL(pi || ref) at token t
    loss      = aggregate(policy) + kl_coeff * aggregate(kl)

Off-policy correction. The sampler (vLLM) and the trainer compute different logprobs for the
same weights (other kernels, precisions, batch shapes), so ``behaviour`` (mu) is not the
trainer's pre-update policy ``pi_old``. With a ``correction`` (decoupled PPO) the ratio is
taken against ``pi_old`` and each token's policy term is weighted by a detached function of
the mismatch ratio ``r``, per token or, at ``correction_level: sequence``, per sequence (the
product of its tokens' ratios; [l, C] are ``correction_low`` and ``correction_cap``):

    ratio_t   = exp(pi_t - pi_old_t)
    r_t       = exp(pi_old_t - mu_t)                  token
    r_i       = exp(sum_{t in i} (pi_old_t - mu_t))   sequence, on every token of i
    tis:      w = min(max(r, l), C)                   truncated importance sampling
    mis:      w = r if l <= r <= C else 0             masked importance sampling
    icepop:   w = r if l <= r <= C else 0             token level, [l, C] = [0.5, 5] by default
    policy_t  = -w * min(ratio_t * A_t, clamp(ratio_t, ...) * A_t)

Sources. TIS: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025), verl's ``tis_imp_ratio_cap``. MIS: TRL's ``vllm_importance_sampling_mode``
``token_mask`` / ``sequence_mask`` (huggingface/trl #4530, with the lower bound of #4732), which
set the ratio outside ``[C_min, C_max]`` to zero and keep it inside; the sequence ratio is the
product of the token ratios (``exp`` of the summed log-ratios), as there and as the
sequence-level TIS before it, not their geometric mean. IcePop: the Ling Team's Ring-1T
(arXiv:2510.18855), ``M(k) = k if alpha <= k <= beta else 0`` on the per-token ratio
``pi_train(theta_old) / pi_infer(theta_old)``, with ``alpha = 0.5``, ``beta = 5``. A masked
token keeps its place in the normaliser (as in both) and gets exactly zero policy gradient;
the KL term, outside ``M`` in IcePop's objective as in TRL's loss, still applies to it.

pi_old is the proximal policy of decoupled PPO: with several epochs the clip bounds how far
each epoch moves from it. With one epoch (``ppo_epochs: 1``) pi_old is the current policy, the
ratio is exactly 1 and nothing is clipped: the loss is the weighted policy gradient
``-w_t * A_t * pi_t``, and the clip settings do nothing (``grpo validate`` refuses them
beside a correction then). Without a correction the behaviour policy is the proximal one, so
the clip bounds the update and the mismatch together.

Every logprob here is one of the distribution that sampled the tokens: the collectors return
vLLM's logprobs after temperature, and the trainer and reference divide their logits by the
same temperature (`grpo.packing.logprobs`).

``ratio_level: sequence`` (GSPO) replaces the token ratio by the sequence ratio
``s_i = exp(mean_{t in i}(pi_t - old_t))``, clipped per sequence, in the GSPO-token form
``sg(s_i) * exp(pi_t - sg(pi_t))``: its value is ``s_i`` on every token of sequence ``i`` and
its gradient is ``s_i * grad pi_t``. Every call also measures the mismatch of ``pi_old`` and
``mu`` (``mismatch_kl``, ``mismatch_max_abs``), whether or not it is corrected.

Every aggregation is a weighted token sum divided by a normaliser, which is what makes
gradient accumulation exact: pass the whole batch's normaliser (`batch_loss_normalizer`) to
every micro-batch and the micro-batch losses add up to the whole-batch loss. Group advantages
are computed before the buffer, in `grpo.objective.advantages`.

Example:
    >>> loss_fn = GRPOLoss(epsilon_high=0.28)
    >>> normalizer = loss_fn.batch_loss_normalizer(torch.cat([p.response_lens for p in packs]))
    >>> for packed in packs:
    ...     stats = loss_fn.compute_loss_from_logprobs(
    ...         model_response_logprobs(model, packed), packed.ref_logprobs, packed.advantages,
    ...         packed.behavior_logprobs, response_lens=packed.response_lens,
    ...         loss_normalizer=normalizer)
    ...     stats.loss.backward()
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

# Allowed values, declared once in grpo.choices (the config's Literal types); exported here.
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

# exp() of a log-ratio above ~88 overflows fp32, and an inf in the unselected branch of the
# clipped objective turns its zero gradient into NaN (0 * inf). Tokens this far off-policy are
# degenerate anyway, so log-ratios are clamped to +-20 before exp (as in verl).
_MAX_LOG_RATIO = 20.0
# The keyword defaults, as `LossArgs` declares them.
_DEFAULT = LossArgs()


def _checked_response_lens(
    response_lens: torch.Tensor | Sequence[int] | None,
    num_tokens: int,
    device: torch.device,
    needed_by: str,
) -> torch.Tensor:
    """``response_lens`` as a long tensor on ``device``, checked against the token count.

    Raises:
        ValueError: If it is missing (``needed_by`` says which setting needs it), not 1-D, or
            does not sum to ``num_tokens``.
    """
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
    """Sum of the flat per-token ``values`` over each sequence's tokens, ``[N]``.

    Callers pass detached ``values``: the sequence-level quantities built from it are
    constants of the loss (GSPO's ``sg(s_i)``, the correction weight), so no gradient flows
    here.
    """
    sums = torch.zeros(num_sequences, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, index.to(values.device), values)


def _per_sequence_sum(values: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """`_sequence_sums` repeated on each of the sequence's tokens, ``[T]``."""
    index = _sequence_index(response_lens, values.numel())
    return _sequence_sums(values, index, response_lens.numel())[index]


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


class GRPOLoss:
    """GRPO / PPO clipped surrogate with a KL penalty to a reference, on packed batches.

    Args:
        epsilon_low (float): Lower clip range: ratios below ``1 - epsilon_low`` stop pushing
            down tokens with negative advantage. In ``[0, 1)``.
        epsilon_high (float): Upper clip range, ``>= 0``; DAPO "clip-higher" sets it above
            ``epsilon_low`` (e.g. 0.28) to leave room for rare tokens to grow.
        kl_coeff (float): Weight ``beta`` of the KL-to-reference term, ``>= 0``. Default 0.0:
            with verifiable rewards the clipped ratio already limits each update and recent
            recipes (DAPO, Dr. GRPO) drop the KL term; set e.g. 0.04 (DeepSeekMath GRPO) to keep
            the policy near the reference. With 0.0, ``ref_logprobs`` may be None.
        kl_estimator (str): ``"k1"`` (``pi - ref``), ``"k2"`` (``0.5 * (pi - ref)^2``) or
            ``"k3"`` (``exp(ref - pi) - (ref - pi) - 1``, unbiased and non-negative), each an
            estimate of KL(pi, ref) from tokens sampled by pi. Differentiated as a loss term,
            k3's expected gradient is that of KL(ref, pi), k2's that of KL(pi, ref), and
            k1's is zero (``E_pi[grad log pi] = 0``), so k1 is refused beside ``kl_coeff > 0``.
        aggregation (str): ``"token_mean"`` (all tokens weigh the same), ``"seq_mean_token_mean"``
            (mean per sequence, then over sequences) or ``"seq_mean_token_sum_norm"``
            (Dr. GRPO: token sum per sequence / ``max_response_len``, then mean over sequences).
        max_response_len (int | None): The Dr. GRPO constant, ``>= 1``; required by, and
            only used by, ``"seq_mean_token_sum_norm"``.
        correction (str): Correction of the sampler/trainer mismatch, ``"none"`` (default: the
            ratio against the behaviour logprobs), ``"tis"``, ``"mis"`` or ``"icepop"`` (the
            module docstring gives each weight and its source). With any of them the PPO
            ratio is taken against the trainer's pre-update logprobs ``pi_old``; on the first
            pass over a batch (``old_logprobs`` None) that ratio is 1 and the clip does nothing.
        correction_level (str): ``"token"`` (a weight per token) or ``"sequence"`` (one weight
            per sequence, from the summed log-ratio of its tokens; needs ``response_lens``).
            ``"icepop"`` is token-level only.
        correction_cap (float | None): Upper bound C of the mismatch ratio (TIS truncates at
            it, MIS and IcePop mask above it); None: the correction's default
            (`grpo.config.sections.CORRECTION_DEFAULT_BOUNDS`).
        correction_low (float | None): Lower bound of the ratio, in ``[0, 1]`` and below C
            (TIS raises the ratio to it, MIS and IcePop mask below it); None: the default.
        tis_cap (float | None): Older spelling of ``correction="tis"`` with this
            ``correction_cap``; refused beside ``correction``.
        tis_level (str): Older spelling of ``correction_level``, read with ``tis_cap``.
        ratio_level (str): ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO: the length-normalised
            sequence ratio, clipped per sequence; needs ``response_lens``). GSPO's ratio stays
            much closer to 1, so it is run with much smaller clip ranges (the paper uses
            ``epsilon_low=3e-4``, ``epsilon_high=4e-4``) and its paper normalisation is
            ``aggregation="seq_mean_token_mean"``.

    Raises:
        ValueError: If a value is out of range, naming the key and what is allowed. The checks
            are those of the config (`grpo.config.sections.LossArgs`), so ``grpo validate``
            refuses the same values.
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
        # The defaults and bounds are the config's (`LossArgs`, their one declaration): `grpo
        # validate` refuses exactly what the loss would refuse here, inside the trainer after
        # the actors started.
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
        if tis_cap is not None:  # the older spelling (refused beside `correction` above)
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

    # ---- normalisation ----------------------------------------------------------------------

    def batch_loss_normalizer(self, response_lens: torch.Tensor | Sequence[int]) -> int:
        """The count a whole batch's loss is divided by, for gradient accumulation.

        ``token_mean``: number of response tokens. ``seq_*``: number of sequences (an empty
        response counts as a sequence with zero loss).

        Args:
            response_lens (torch.Tensor | Sequence[int]): Trained tokens (the policy's: all of
                a single-turn response) of EVERY sequence of the batch, across all its
                micro-batches.

        Returns:
            int: Pass it as ``loss_normalizer`` to every micro-batch of the batch.
        """
        lens = torch.as_tensor(response_lens)
        if self.aggregation == "token_mean":
            return int(lens.sum())
        return lens.numel()

    def _token_weights(
        self, num_tokens: int, response_lens: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor | None, int]:
        """Per-token weights and the local normaliser count of the configured aggregation.

        Every aggregation is ``sum_t weight_t * x_t / normalizer``: weight 1 for token_mean,
        ``1 / len(seq)`` for seq_mean_token_mean and ``1 / max_response_len`` for Dr. GRPO.
        """
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

    # ---- the loss ---------------------------------------------------------------------------

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
            pi_logprobs (torch.Tensor): Current policy logprobs ``[T]`` (carries the graph).
            ref_logprobs (torch.Tensor | None): Reference logprobs ``[T]``; may be None only
                when ``kl_coeff == 0``.
            advantages (torch.Tensor): Per-token advantages ``[T]``.
            behavior_logprobs (torch.Tensor | None): Logprobs of the policy that sampled the
                tokens ``[T]`` (mu, from the sampler). None means on-policy: mu is ``pi_old``,
                and the ratio ``exp(pi - pi.detach())`` when ``old_logprobs`` is None too
                (value 1, gradient of pi).
            old_logprobs (torch.Tensor | None): The trainer's logprobs of the pre-update policy
                ``[T]`` (pi_old, computed without gradient). The ratio's reference under a
                ``correction``, and the trainer side of the mismatch metrics. None: this is
                the first pass over the batch, so pi_old is ``pi_logprobs.detach()``.
            response_lens (torch.Tensor | None): Tokens per sequence ``[N]`` (summing to ``T``);
                required by the ``seq_*`` aggregations, ``ratio_level="sequence"`` and
                ``correction_level="sequence"`` (with a correction).
            loss_mask (torch.Tensor | None): Bool ``[T]``, True on the tokens to train
                (``PackedTrajectory.loss_mask``: the policy's tokens of a multi-turn episode).
                The loss, its token and sequence counts, clip fraction, KL, correction weights,
                sequence ratios and every metric are then those of the True tokens alone, as
                if the others were not there; they get exactly zero gradient. None: all.
            loss_normalizer (float | int | torch.Tensor | None): The whole batch's count (see
                `batch_loss_normalizer`) when accumulating gradients over micro-batches; None
                normalises within this call.
            return_pi_logprobs (bool): Put detached ``pi_logprobs`` in ``metadata``.

        Returns:
            GRPOStats: ``loss`` (with graph), ``policy_loss``, ``kl_loss``; token means of
            ``ratios`` (the clipped objective's ratio: ``exp(pi - behaviour)`` by default,
            against pi_old with a correction, the sequence ratio on each of its tokens with
            ``ratio_level="sequence"``), ``clipfrac`` and ``approx_policy_kls``
            (``0.5 * (pi - behaviour)^2``, a second-order estimate of KL(behaviour || pi)).
            ``metadata`` holds ``num_tokens``, ``num_sequences``, ``loss_normalizer``,
            ``normalizer_count`` (this call's share of the normaliser), ``kl_to_ref`` (token
            mean of the KL estimate), ``mismatch_kl`` (token mean of the k3 estimate of
            KL(mu || pi_old): ``r - 1 - log r`` with ``r = exp(pi_old - mu)``),
            ``mismatch_max_abs`` (max over tokens of ``|pi_old - mu|``), ``masked_tokens``
            (tokens whose correction weight is a mask, 0) and ``masked_sequences``
            (sequences masked whole, at ``correction_level="sequence"``), both counts as
            float tensors, and optionally ``pi_logprobs``; see `combine_stats`.

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
            # Selecting the trained tokens first makes every term below (aggregation weights,
            # per-sequence sums, token means) exactly that of the policy tokens alone.
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

        # With a correction the clipped ratio measures only this update (pi against pi_old);
        # the sampler/trainer mismatch is corrected by the weight below instead.
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
            # GSPO-token: exp(pi - sg(pi)) is exactly 1 in value, so every token carries s_i,
            # and its gradient turns s_i into s_i * grad pi_t.
            ratio = torch.exp(log_sequence_ratio) * torch.exp(pi_logprobs - pi_logprobs.detach())
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high) * advantages
        # min() picks the clipped term exactly where it is strictly smaller; select with the
        # same mask so that clipfrac counts the tokens whose gradient the clip removed.
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
        """Per-token weights of the configured correction (detached), and what it masked.

        The weights are those of the module docstring: ``min(max(r, low), cap)`` for TIS,
        ``r`` inside ``[low, cap]`` and 0 outside for MIS and IcePop, with ``r =
        exp(pi_old - mu)`` per token or, at sequence level, ``exp`` of the summed log-ratio of
        the sequence, shared by its tokens.

        Returns:
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]: The weights ``[T]``, the number
            of masked tokens and the number of sequences masked whole (float scalars).
        """
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
        # Clamp before exp so a far-off sequence cannot overflow to inf; the cap then applies
        # to a finite number. No lower clamp: a weight that underflows to 0 is exact enough.
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
        # where(), not a product with a 0/1 mask: a masked weight is exactly 0, so is its
        # token's gradient, whatever the ratio was.
        weights = torch.where(masked, torch.zeros_like(ratio), ratio)
        return weights, masked.sum().float(), masked_sequences


def combine_stats(stats: Sequence[GRPOStats]) -> GRPOStats:
    """Exact whole-batch stats from the stats of its micro-batches (detached, for logging).

    Token means (``ratios``, ``clipfrac``, ``approx_policy_kls``, ``kl_to_ref``,
    ``mismatch_kl``) are weighted by each call's ``num_tokens``; ``mismatch_max_abs`` is the
    max over calls; the counts ``masked_tokens`` and ``masked_sequences`` are summed. A loss
    part is ``sum(part * loss_normalizer) / sum(normalizer_count)``: the plain sum when every
    call used the whole batch's normaliser, and the exact batch mean when each call normalised
    by its own count.

    Args:
        stats (Sequence[GRPOStats]): Stats returned by `GRPOLoss`.

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
