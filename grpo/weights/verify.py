"""Proving an engine computes with the weights it was sent, and going back when it does not."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from grpo.types import UnscoredTrajectory
from grpo.weights.checksum import WeightSyncError

PROBE_ID_PREFIX = "probe-"  # of a probe's request id, which no episode's request has
_PROBE_IDS = itertools.count()


class ProbeTolerance(NamedTuple):
    """How far an engine's probe logprobs may be from the sender's.

    Attributes:
        atol: Of each token: ``|difference| <= atol + rtol * |sender's logprob|``.
        rtol: See ``atol``.
        mean_atol: Of the mean over the probe's tokens: ``mean |difference| <= mean_atol +
            mean_rtol * mean |sender's logprob|``.
        mean_rtol: See ``mean_atol``.
    """

    atol: float
    rtol: float
    mean_atol: float
    mean_rtol: float


# float32 on both ends agrees to ~1e-5 per token.
FP32_PROBE_TOLERANCE = ProbeTolerance(1e-3, 0.0, 1e-3, 0.0)
# In bf16 two kernels (torch's and vLLM's) round differently, and one token's logprob can move
# by more than half a nat once training has sharpened the model. Rounding errors grow with the
# logits, and so do the probe's logprobs (its tokens are unlikely ones). Measured with vLLM and
# torchtune in bf16, 61 sequences of 16 tokens, on the demo model untrained, trained 600 steps
# in bf16, and with 3x sharper logits: a token was at most 0.77 off (4.7% of its logprob), a
# sequence's mean at most 0.72% of its mean |logprob| (0.135 at a mean of 35). An engine
# holding the other model's weights was 7.3% off or more (0.79 to 3 nats a sequence). So a
# token gets a loose bound (a wrong row of one weight still shows) and the mean a tight one.
REDUCED_PRECISION_PROBE_TOLERANCE = ProbeTolerance(1.0, 0.05, 0.05, 0.02)


def probe_token_ids(vocab_size: int) -> list[int]:
    """The fixed 16-token sequence that every probe scores (ids below 256 and ``vocab_size``)."""
    return [(7 * i + 3) % min(vocab_size, 256) for i in range(16)]


def probe_sequence(token_ids: Sequence[int], policy_version: int = 0) -> UnscoredTrajectory:
    """``token_ids`` as the sequence a trainer scores for a probe: its first token the prompt,
    the others the response whose logprobs the engine must reproduce."""
    return UnscoredTrajectory(
        prompt_tokens=torch.tensor(token_ids[:1]),
        response_tokens=torch.tensor(token_ids[1:]),
        prompt_len=1,
        response_len=len(token_ids) - 1,
        logprobs=torch.zeros(len(token_ids) - 1),
        answer="",
        sequence_id="weight-sync-probe",
        policy_version=policy_version,
        group_id=-1,
    )


def probe_tolerance(dtype: torch.dtype) -> ProbeTolerance:
    """The tolerance of a probe whose sender computes in ``dtype``."""
    return FP32_PROBE_TOLERANCE if dtype == torch.float32 else REDUCED_PRECISION_PROBE_TOLERANCE


def check_checksums(checksums: Sequence[str | None], expected: str, version: int) -> None:
    """Check the checksum each vLLM worker computed of the tensors it loaded.

    Raises:
        WeightSyncError: If a worker's differs from the sender's ``expected``.
    """
    for rank, checksum in enumerate(checksums):
        if checksum != expected:
            raise WeightSyncError(
                f"weights of version {version}: vLLM worker {rank} loaded tensors "
                f"with checksum {checksum}, the sender's checksum is {expected}"
            )


def probe_logprobs(
    add_request: Callable[[str, Sequence[int], Any], None],
    engine_step: Callable[[], list[Any]],
    token_ids: Sequence[int],
) -> list[float]:
    """The engine's logprob of every token of ``token_ids`` after the first.

    The probe is an ordinary request (hold the engine lock); running samples go on beside it.

    Args:
        add_request: ``add_request(request_id, token_ids, params)`` on the engine.
        engine_step: One step of the engine; returns the requests that finished.

    Returns:
        list[float]: ``len(token_ids) - 1`` logprobs, from unscaled logits.

    Raises:
        ValueError: With fewer than two token ids.
    """
    from vllm import SamplingParams

    token_ids = [int(t) for t in token_ids]
    if len(token_ids) < 2:
        raise ValueError(f"probe_logprobs needs at least 2 token ids, got {len(token_ids)}")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request_id = f"{PROBE_ID_PREFIX}{next(_PROBE_IDS)}"
    add_request(request_id, token_ids, params)
    output = None
    while output is None:
        output = next((o for o in engine_step() if o.request_id == request_id), None)
    # prompt_logprobs[0] is None: nothing precedes the first token.
    return [
        float(entry[token].logprob)
        for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])
    ]


def check_probe(logprobs: Sequence[float], probe: Mapping[str, Any], version: int) -> None:
    """Compare the engine's ``logprobs`` of a probe with the sender's.

    Each logprob may differ by ``atol + rtol * |sender's|``, and the mean difference over the
    probe by ``mean_atol + mean_rtol * mean |sender's|`` (`ProbeTolerance`). Rounding in a
    reduced precision moves single tokens far more than it moves the mean; other weights move
    the mean.

    Args:
        logprobs: `probe_logprobs` of ``probe["token_ids"]``.
        probe: ``{"token_ids", "logprobs"}`` and the fields of a `ProbeTolerance`; ``atol``
            and ``rtol`` default to `FP32_PROBE_TOLERANCE`'s, the mean to no bound of its own.
        version: The version probed, for the error.

    Raises:
        WeightSyncError: If a token or the mean differs by more than that, or one is NaN.
    """
    atol = float(probe.get("atol", FP32_PROBE_TOLERANCE.atol))
    rtol = float(probe.get("rtol", FP32_PROBE_TOLERANCE.rtol))
    mean_atol = float(probe.get("mean_atol", float("inf")))
    mean_rtol = float(probe.get("mean_rtol", 0.0))
    got = torch.tensor(logprobs)
    expected = torch.tensor(probe["logprobs"], dtype=torch.float32)
    if got.shape != expected.shape:
        raise WeightSyncError(
            f"weights of version {version}: the engine returned {got.numel()} probe logprobs, "
            f"the sender {expected.numel()}"
        )
    if not got.numel():
        return
    diff = (got - expected).abs()
    excess = float((diff - rtol * expected.abs()).max())
    mean = float(diff.mean())
    mean_bound = mean_atol + mean_rtol * float(expected.abs().mean())
    # "not <=" so NaN logprobs (e.g. memory a wake did not restore) fail too.
    if not excess <= atol:
        tolerance = f"atol {atol:g}" + (f", rtol {rtol:g}" if rtol else "")
        found = f"differ from the sender's by up to {float(diff.max()):.3g} ({tolerance})"
    elif not mean <= mean_bound:
        found = f"differ from the sender's by {mean:.3g} on average (at most {mean_bound:.3g})"
    else:
        return
    raise WeightSyncError(
        f"weights of version {version}: the engine's probe logprobs {found}; the engine does "
        "not compute with the sent weights"
    )


def roll_back(llm: Any, weights: Mapping[str, torch.Tensor] | None, model_dir: str) -> None:
    """Reload the weights from before a rejected update and drop every KV block it computed.

    Args:
        weights: Those weights; None: those of ``model_dir``, the engine's model folder.
    """
    if weights is None:
        from grpo.models import load_hf_state_dict

        weights = load_hf_state_dict(model_dir)
    llm.collective_rpc("grpo_update_weights", args=(weights, True))
    llm.reset_prefix_cache(reset_running_requests=True)
