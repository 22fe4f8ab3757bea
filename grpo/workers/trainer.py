"""The trainer: `PyTorchActorModel`, one per training worker.

Each step every worker gets the whole batch, takes its share, packs it into micro-batches and
accumulates gradients normalised by the whole batch's count, so the update does not depend on
how the batch was split. Several workers shard the model with FSDP2. With ``training.lora``
only the adapters are trained, checkpointed and published, and the reference logprobs are the
same model's with the adapters off.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtune.modules.peft import disable_adapter

from grpo.config import instantiate
from grpo.config.sections import TrainingConfig
from grpo.models import (
    build_model,
    load_hf_config,
    save_hf_checkpoint,
    torch_dtype,
    tune_to_hf_state_dict,
)
from grpo.models.lora import (
    apply_lora,
    is_adapter_key,
    merge_lora,
    peft_adapter_config,
    peft_adapter_state_dict,
    save_peft_adapter,
    trainable_parameters,
)
from grpo.objective.loss import combine_stats
from grpo.observability import metric_names as names
from grpo.packing.attention import resolve_mask_kind, use_packed_attention
from grpo.packing.logprobs import model_response_logprobs
from grpo.packing.packs import (
    FLEX_BUCKET,
    pack_sequences,
    plan_sequence_packs,
    shard_batch,
    unpack_response_logprobs,
)
from grpo.types import GRPOStats, PackedTrajectory, ScoredTrajectory
from grpo.weights.base import SendingEnd
from grpo.weights.checksum import adapter_checksum, state_dict_checksum
from grpo.weights.concurrency import TRAINER_CONCURRENCY_GROUPS
from grpo.weights.transports import sending_end
from grpo.weights.verify import probe_sequence, probe_token_ids, probe_tolerance
from grpo.workers.training_checkpoint import (
    ADAPTER_SUBDIR,
    MODEL_SUBDIR,
    TRAINER_SUBDIR,
    carry_over_hyperparameters,
    load_training_state,
    save_training_state,
)


class ResponseLogprobModel(nn.Module):
    """Wraps a torchtune decoder so one forward returns response-token logprobs.

    FSDP2 unshards the root's own parameters (output projection included) only inside the
    root's forward, so the chunked projection must run in this forward.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, packed: PackedTrajectory, temperature: float = 1.0) -> torch.Tensor:
        return model_response_logprobs(self.model, packed, temperature=temperature)


def _select_logprobs(
    packed: PackedTrajectory, logprobs: torch.Tensor, wanted: set[str]
) -> dict[str, list[float]]:
    """The response logprobs of the ``wanted`` sequences of a pack, as plain lists."""
    per_sequence = unpack_response_logprobs(packed, logprobs.detach())
    return {
        sequence_id: values.float().tolist()
        for sequence_id, values in zip(packed.sequence_ids, per_sequence)
        if sequence_id in wanted
    }


def compile_layers(decoder: nn.Module) -> nn.Module:
    """``torch.compile`` each decoder layer in place, as torchtune's ``compile_model`` does.

    Per layer, so the chunked output projection (a custom autograd function) stays out of the
    graph; ``Module.compile`` keeps the parameter names. Returns ``decoder`` itself.
    """
    for layer in decoder.layers:
        layer.compile(backend="inductor", dynamic=None)
    return decoder


def _set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _loss_uses_reference(loss_fn: Any) -> bool:
    """Whether the loss has a KL term (``kl_coeff`` > 0; a loss without one is assumed to)."""
    kl_coeff = getattr(loss_fn, "kl_coeff", None)
    return kl_coeff is None or float(kl_coeff) > 0.0


class PyTorchActorModel:
    """One training worker; `as_remote` makes it a Ray actor class.

    Args:
        num_steps: Training steps of the run (sizes the LR schedule).
        share_prompts: Pack a prompt's responses after one copy of it, and shard by prompts.
        config: The ``training:`` options; None: their defaults.
        temperature: ``inference.temperature``, so the policy's logprobs match the engine's.
        empty_cache_after_step: Give cached GPU memory back after each step (vLLM wakes on
            the same GPU next).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        model_dir: str,
        num_steps: int,
        target_tokens_per_batch: int,
        pad_token_id: int,
        share_prompts: bool = True,
        config: TrainingConfig | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        empty_cache_after_step: bool = False,
    ) -> None:
        config = config or TrainingConfig()
        self.rank = rank
        self.temperature = float(temperature)
        self.empty_cache_after_step = empty_cache_after_step
        self.world_size = world_size
        self.model_dir = str(model_dir)
        self.hf_config = load_hf_config(self.model_dir)
        self.target_tokens_per_batch = target_tokens_per_batch
        self.pad_token_id = pad_token_id
        self.share_prompts = share_prompts
        self.ppo_epochs = config.ppo_epochs
        self.clip_grad_norm = config.clip_grad_norm
        self.compile = config.compile
        self.lora = config.lora
        # LoRA with a KL term: the reference is this model with the adapter off (set in setup).
        self.computes_reference = False
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.mask_kind = resolve_mask_kind(config.mask_kind, self.device)
        self.dtype = torch_dtype(config.dtype)
        self._component_nodes = {
            "optimizer": config.optimizer,
            "lr_scheduler": config.lr_scheduler,
            "loss": config.loss,
        }
        self.num_steps = num_steps
        self.seed = seed
        self.steps_run = 0
        self.policy_version = 0
        self.num_nonfinite_skipped = 0
        self._nonfinite_in_a_row = 0
        self.weight_sender: SendingEnd | None = None

    @classmethod
    def as_remote(cls, **options: Any) -> Any:
        """This class as a Ray actor class with ``ray.remote`` ``options``, weight transfers in
        their own concurrency group."""
        import ray

        return ray.remote(**{"concurrency_groups": TRAINER_CONCURRENCY_GROUPS, **options})(cls)

    def setup(self, dist_init_method: str | None = None, checkpoint_dir: str | None = None) -> None:
        """Join the process group (several workers), build the model, optimizer and loss.

        Separate from ``__init__`` because rank 0's address is known only once it exists.

        Args:
            dist_init_method: ``tcp://host:port`` of rank 0; required when ``world_size > 1``.
            checkpoint_dir: Resume from this checkpoint (``model/`` or, with ``lora``, the
                base model, then ``trainer/``); the config's optimizer settings and
                ``num_steps`` apply from there.

        Raises:
            ValueError: Several workers and no ``dist_init_method``.
        """
        world_size, rank = self.world_size, self.rank
        if world_size > 1:
            if dist_init_method is None:
                raise ValueError("dist_init_method is required when num_training_workers > 1")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=dist_init_method, rank=rank, world_size=world_size
            )
        # Same seed on every rank: identical initial weights before sharding.
        _set_seed(self.seed)
        # A LoRA checkpoint holds no full model: the frozen base is always the base model.
        weights_dir = (
            str(Path(checkpoint_dir) / MODEL_SUBDIR)
            if checkpoint_dir and self.lora is None
            else self.model_dir
        )
        decoder = build_model(
            weights_dir,
            dtype=self.dtype,
            device=self.device,
            packed_len=self.target_tokens_per_batch,
        )
        if self.lora is not None:
            # After the seed: every rank draws the same initial adapters before sharding.
            apply_lora(decoder, self.lora)
        if self.mask_kind != "dense":
            use_packed_attention(decoder)
        if self.compile:
            compile_layers(decoder)
        self.policy = ResponseLogprobModel(decoder)
        if world_size > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in decoder.layers:
                fully_shard(layer)
            fully_shard(self.policy)
        self.policy.train()

        nodes = self._component_nodes
        self.loss_fn = instantiate(nodes["loss"], _key_="training.loss")
        self.computes_reference = self.lora is not None and _loss_uses_reference(self.loss_fn)
        parameters = (
            trainable_parameters(self.policy) if self.lora is not None else self.policy.parameters()
        )
        self.optimizer = instantiate(nodes["optimizer"], parameters, _key_="training.optimizer")
        self.lr_scheduler = (
            instantiate(
                nodes["lr_scheduler"],
                self.optimizer,
                num_training_steps=self.num_steps * self.ppo_epochs,
                _key_="training.lr_scheduler",
            )
            if nodes["lr_scheduler"]
            else None
        )
        if checkpoint_dir:
            self._load_training_state(Path(checkpoint_dir) / TRAINER_SUBDIR)

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Write ``model/`` (HF format, from rank 0) and ``trainer/`` into ``checkpoint_dir``.

        ``trainer/`` holds each rank's shards of model and optimizer state, the LR schedule,
        counters and RNG. With ``lora``, ``adapter/`` (a PEFT folder) replaces ``model/``.
        Collective: every rank must see the same ``checkpoint_dir``.
        """
        checkpoint_dir = Path(checkpoint_dir)
        if self.lora is not None:
            adapter = self.adapter_state_dict()
            if self.rank == 0:
                save_peft_adapter(
                    checkpoint_dir / ADAPTER_SUBDIR,
                    peft_adapter_state_dict(adapter, self.hf_config),
                    peft_adapter_config(self.lora, self.model_dir),
                )
            del adapter
        else:
            # Freed before the sharded save, to hold one full copy at a time.
            tune_state = self.full_state_dict()
            if self.rank == 0:
                save_hf_checkpoint(tune_state, self.model_dir, checkpoint_dir / MODEL_SUBDIR)
            del tune_state
        extra = {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            # The configured lr: a resume with another one scales the schedule by the ratio.
            "optimizer_lr": float(self.optimizer.defaults["lr"]),
            "steps_run": self.steps_run,
            "policy_version": self.policy_version,
            "num_nonfinite_skipped": self.num_nonfinite_skipped,
            "nonfinite_in_a_row": self._nonfinite_in_a_row,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        save_training_state(
            self.policy, self.optimizer, checkpoint_dir / TRAINER_SUBDIR, extra=extra
        )

    def _load_training_state(self, folder: Path) -> None:
        state = load_training_state(self.policy, self.optimizer, folder)
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        carry_over_hyperparameters(self.optimizer, self.lr_scheduler, state.get("optimizer_lr"))
        self.steps_run = state["steps_run"]
        self.policy_version = state["policy_version"]
        self.num_nonfinite_skipped = state["num_nonfinite_skipped"]
        self._nonfinite_in_a_row = state["nonfinite_in_a_row"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    def _plan_micro_batches(
        self, batch: list[ScoredTrajectory]
    ) -> tuple[list[list[ScoredTrajectory]], int]:
        """This rank's packs, and how many micro-batches every rank must run.

        Each rank plans every rank's share, so all agree without communicating.
        """
        budget, share = self.target_tokens_per_batch, self.share_prompts
        shards = [
            [batch[i] for i in shard]
            for shard in shard_batch(batch, self.world_size, budget, share_prompts=share)
        ]
        plans = [
            plan_sequence_packs(shard, budget, share_prompts=share) if shard else []
            for shard in shards
        ]
        mine = [[shards[self.rank][i] for i in pack] for pack in plans[self.rank]]
        return mine, max(len(plan) for plan in plans)

    def train_step(
        self,
        batch: list[ScoredTrajectory],
        time_waiting_buffer: float = 0.0,
        debug_sequence_ids: list[str] | None = None,
    ) -> dict[str, Any]:
        """Run ``ppo_epochs`` optimizer steps on one batch.

        A step whose loss or gradient norm is not finite is skipped and counted.

        Args:
            batch: The whole batch (identical on every worker).
            debug_sequence_ids: Sequences whose first-epoch policy logprobs to return under
                ``"debug_pi_logprobs"``.

        Returns:
            dict[str, float]: Metrics of the step (``training/`` and ``training_perf/``), summed
            over workers.
        """
        step_start = time.perf_counter()
        micro_batches, num_micro_batches = self._plan_micro_batches(batch)
        packs = [
            pack_sequences(
                mb,
                self.device,
                self.pad_token_id,
                mask_kind=self.mask_kind,
                pad_to_multiple_of=FLEX_BUCKET if self.mask_kind == "flex" else None,
                share_prompts=self.share_prompts,
            )
            for mb in micro_batches
        ]
        normalizer = self.loss_fn.batch_loss_normalizer([t.policy_len for t in batch])
        step_stats: list[GRPOStats] = []
        wanted = set(debug_sequence_ids or ())
        debug_pi_logprobs: dict[str, list[float]] = {}
        grad_norm = torch.tensor(0.0)
        skipped = False
        grpo_start = time.perf_counter()
        reference_start = time.perf_counter()
        ref_logprobs = self._reference_logprobs(packs, num_micro_batches)
        time_reference = time.perf_counter() - reference_start
        old_logprobs = self._old_logprobs(packs, num_micro_batches)
        for _epoch in range(self.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
            for index in range(num_micro_batches):
                # A rank with fewer packs repeats one with zero weight so that FSDP's
                # collectives line up across ranks.
                is_filler = index >= len(packs)
                packed = packs[index % len(packs)] if packs else None
                if packed is None:
                    raise RuntimeError(
                        f"training[{self.rank}] got no sequences: training.batch_size must be "
                        f">= num_training_workers"
                    )
                pi_logprobs = self.policy(packed, self.temperature)
                if wanted and _epoch == 0 and not is_filler:
                    debug_pi_logprobs.update(_select_logprobs(packed, pi_logprobs, wanted))
                stats = self.loss_fn.compute_loss_from_logprobs(
                    pi_logprobs,
                    ref_logprobs[index % len(packs)],
                    packed.advantages,
                    packed.behavior_logprobs,
                    old_logprobs=old_logprobs[index % len(packs)],
                    response_lens=packed.response_lens,
                    loss_mask=packed.loss_mask,
                    loss_normalizer=normalizer,
                )
                # FSDP averages gradients over ranks; the loss is already normalised by the
                # whole batch, so multiply by the world size to get the sum.
                scale = 0.0 if is_filler else float(self.world_size)
                (stats.loss * scale).backward()
                if is_filler:
                    continue
                epoch_loss += stats.loss.detach().double()
                step_stats.append(stats)
            total_loss = float(self._all_reduce_sum(epoch_loss))
            grad_norm = self._clip_and_norm()
            if not (math.isfinite(total_loss) and math.isfinite(float(grad_norm))):
                skipped = True
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        time_grpo_steps = time.perf_counter() - grpo_start
        loss_metrics = self._combined_loss_metrics(step_stats)

        # The driver decides when too many skips in a row mean the run has diverged.
        if skipped:
            self.num_nonfinite_skipped += 1
            self._nonfinite_in_a_row += 1
        else:
            self._nonfinite_in_a_row = 0
        self.steps_run += 1

        real_tokens = sum(p.actual_total_tokens for p in packs)
        packed_tokens = sum(p.packed_seq_len for p in packs)
        shared_tokens = sum(p.shared_prompt_tokens for p in packs)
        response_tokens = sum(t.response_len for t in batch)
        policy_tokens = sum(t.policy_len for t in batch)
        # In training steps: the weights this step updated had taken steps_run - 1 of them.
        ages = [self.steps_run - 1 - t.policy_version for t in batch]
        metrics: dict[str, Any] = {
            **loss_metrics,
            names.TRAIN_GRAD_NORM: float(grad_norm),
            names.TRAIN_LR: self.optimizer.param_groups[0]["lr"],
            names.TRAIN_RESPONSE_LENGTHS: response_tokens / len(batch),
            "training/trained_token_fraction": (
                policy_tokens / response_tokens if response_tokens else 1.0
            ),
            names.TRAIN_POLICY_AGE_MEAN: sum(ages) / len(ages),
            names.TRAIN_POLICY_AGE_MAX: float(max(ages)),
            "training/num_micro_batches": float(len(packs)),
            "training/nonfinite_steps_skipped": float(self.num_nonfinite_skipped),
            names.TRAIN_NONFINITE_STEPS_IN_A_ROW: float(self._nonfinite_in_a_row),
            names.TRAIN_PERF_TOTAL_STEP_TIME: (
                time.perf_counter() - step_start + time_waiting_buffer
            ),
            names.TRAIN_PERF_TIME_GRPO_STEPS: time_grpo_steps,
            names.TRAIN_PERF_TIME_TRAIN_COMPUTE: time.perf_counter() - step_start,
            names.TRAIN_PERF_TIME_WAITING_BUFFER: time_waiting_buffer,
            names.TRAIN_PERF_TOKENS_PER_SECOND: (
                response_tokens * self.ppo_epochs / time_grpo_steps if time_grpo_steps else 0.0
            ),
            names.TRAIN_PERF_PADDED_TOKENS_PERCENTAGE: (
                100.0 * (packed_tokens - real_tokens) / packed_tokens if packed_tokens else 0.0
            ),
            names.TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED: (
                100.0 * shared_tokens / (real_tokens + shared_tokens) if real_tokens else 0.0
            ),
        }
        if self.computes_reference:
            metrics["training_perf/time_reference_forward"] = time_reference
        if wanted:
            metrics["debug_pi_logprobs"] = debug_pi_logprobs
        if self.empty_cache_after_step and self.device.type == "cuda":
            # The allocator keeps the step's peak reserved; vLLM wakes on the same GPU next.
            torch.cuda.empty_cache()
        return metrics

    def _old_logprobs(
        self, packs: list[PackedTrajectory], num_micro_batches: int
    ) -> list[torch.Tensor | None]:
        """pi_old of each pack, or Nones with one epoch (the loss then takes it from its forward).

        Runs ``num_micro_batches`` forwards, fillers included, so FSDP's collectives line up.
        """
        if self.ppo_epochs == 1 or not packs:
            return [None] * len(packs)
        old_logprobs: list[torch.Tensor | None] = []
        with torch.no_grad():
            for index in range(num_micro_batches):
                logprobs = self.policy(packs[index % len(packs)], self.temperature)
                if index < len(packs):
                    old_logprobs.append(logprobs.detach().float())
        return old_logprobs

    def _reference_logprobs(
        self, packs: list[PackedTrajectory], num_micro_batches: int
    ) -> list[torch.Tensor | None]:
        """Each pack's reference logprobs: its own, or under LoRA this model's with the adapter off.

        Runs ``num_micro_batches`` forwards, fillers included, so FSDP's collectives line up.
        """
        if not self.computes_reference or not packs:
            return [packed.ref_logprobs for packed in packs]
        ref_logprobs: list[torch.Tensor | None] = []
        with torch.no_grad(), disable_adapter(self.policy.model):
            for index in range(num_micro_batches):
                logprobs = self.policy(packs[index % len(packs)], self.temperature)
                if index < len(packs):
                    ref_logprobs.append(logprobs.detach().float())
        return ref_logprobs

    def _combined_loss_metrics(self, step_stats: list[GRPOStats]) -> dict[str, float]:
        """The step's loss metrics over every micro-batch, epoch and rank, exact however split."""
        combined = combine_stats(step_stats)
        count = float(combined.metadata["normalizer_count"])
        tokens = float(combined.metadata["num_tokens"])
        weighted = {
            "loss": float(combined.loss) * count,
            "policy_loss": float(combined.policy_loss) * count,
            "kl_loss": float(combined.kl_loss) * count,
            "normalizer_count": count,
            "ratios": float(combined.ratios) * tokens,
            "clipfrac": float(combined.clipfrac) * tokens,
            "approx_policy_kls": float(combined.approx_policy_kls) * tokens,
            "kl_to_ref": float(combined.metadata["kl_to_ref"]) * tokens,
            "mismatch_kl": float(combined.metadata["mismatch_kl"]) * tokens,
            "masked_tokens": float(combined.metadata["masked_tokens"]),
            "masked_sequences": float(combined.metadata["masked_sequences"]),
            "num_tokens": tokens,
            "num_sequences": float(combined.metadata["num_sequences"] or 0),
        }
        summed = self._all_reduce_sum(torch.tensor(list(weighted.values()), dtype=torch.float64))
        total = dict(zip(weighted, summed.tolist()))
        mismatch_max_abs = self._all_reduce_max(
            torch.tensor(float(combined.metadata["mismatch_max_abs"]), dtype=torch.float64)
        )
        count, tokens = max(total["normalizer_count"], 1.0), max(total["num_tokens"], 1.0)
        metrics = {
            f"training/{name}": total[name] / count for name in ("loss", "policy_loss", "kl_loss")
        }
        for name in ("ratios", "clipfrac", "approx_policy_kls", "kl_to_ref", "mismatch_kl"):
            metrics[f"training/{name}"] = total[name] / tokens
        metrics[names.TRAIN_MISMATCH_MAX_ABS] = float(mismatch_max_abs)
        # Counts over every epoch: each sees the same pi_old and mu, so the same masks.
        metrics[names.TRAIN_CORRECTION_MASKED_FRACTION] = total["masked_tokens"] / tokens
        metrics[names.TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION] = total["masked_sequences"] / max(
            total["num_sequences"], 1.0
        )
        return metrics

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.to(self.device, copy=True)
            dist.all_reduce(value)
        return value.cpu()

    def _all_reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.to(self.device, copy=True)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.cpu()

    def _clip_and_norm(self) -> torch.Tensor:
        max_norm = self.clip_grad_norm if self.clip_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.detach().float().cpu()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights in torchtune names, on CPU (``lora``: unmerged). Collective."""
        return self._gathered(lambda name: True)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) LoRA adapter tensors in torchtune names, on CPU. Collective.

        Raises:
            RuntimeError: Without ``lora`` (there is no adapter).
        """
        if self.lora is None:
            raise RuntimeError("adapter_state_dict: this trainer has no adapter (training.lora)")
        return self._gathered(is_adapter_key)

    def _gathered(self, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """The model's state dict entries whose name ``keep`` accepts, unsharded, on CPU."""
        state = {}
        # Every rank visits the same names in the same order, so the all-gathers line up.
        for name, tensor in self.policy.model.state_dict().items():
            if not keep(name):
                continue
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            state[name] = tensor.detach().to("cpu", copy=True)
        return state

    def _published_weights(self) -> dict[str, torch.Tensor] | None:
        """Full weights in HF names (``lora``: adapters in PEFT names) on rank 0, else None."""
        if self.lora is not None:
            adapter = self.adapter_state_dict()
            return peft_adapter_state_dict(adapter, self.hf_config) if self.rank == 0 else None
        tune_state = self.full_state_dict()
        return tune_to_hf_state_dict(tune_state, self.hf_config) if self.rank == 0 else None

    @torch.no_grad()
    def probe_logprobs(self) -> dict[str, Any]:
        """Logprobs of a fixed token sequence under the current weights.

        A collector that loaded the same weights must reproduce them. Collective.
        """
        vocab_size = int(self.hf_config["vocab_size"])
        token_ids = probe_token_ids(vocab_size)
        probe = probe_sequence(token_ids, self.policy_version)
        packed = pack_sequences([probe], self.device, self.pad_token_id)
        # Temperature 1: the engine scores the probe with prompt logprobs, which are always
        # those of the unscaled logits.
        logprobs = self.policy(packed).float().cpu().tolist()
        return {
            "token_ids": token_ids,
            "logprobs": logprobs,
            **probe_tolerance(self.dtype)._asdict(),
        }

    def publish_weights(self, transport: str) -> dict[str, Any] | None:
        """Gather the full weights and publish them (rank 0), as version ``steps_run``.

        A version counts training steps (0: the base model), so staleness is in steps
        whatever ``weight_sync.every_n_steps`` is. With ``lora`` only the adapters are
        published. Collective.

        Returns:
            dict | None: On rank 0 ``{"version", "checksum", "probe", "weights"}``, with
            ``weights`` what the sending end published; None on the other ranks.
        """
        weights = self._published_weights()
        probe = self.probe_logprobs()
        self.policy_version = self.steps_run
        if weights is None:  # not rank 0
            return None
        if self.weight_sender is None:
            self.weight_sender = sending_end(transport, f"training[{self.rank}]", self.device.type)
        return {
            "version": self.policy_version,
            "checksum": state_dict_checksum(weights),
            "probe": probe,
            "weights": self.weight_sender.publish(self.policy_version, weights),
        }

    def connect_weights(self, collector: str, timeout_s: float, bucket_bytes: int) -> Any:
        """`SendingEnd.connect` on rank 0 (after a publish): what ``collector`` joins."""
        return self.weight_sender.connect(collector, timeout_s, bucket_bytes)

    def send_weights(self, collector: str, version: int) -> float:
        """`SendingEnd.send` on rank 0: the published weights to ``collector``."""
        return self.weight_sender.send(collector, version)

    def weights_checksum(self) -> Any:
        """Checksum of what `publish_weights` sends, as the collectors compute it. Collective."""
        weights = self._published_weights()
        if weights is None:
            return None
        return adapter_checksum(weights) if self.lora is not None else state_dict_checksum(weights)

    def save_hf_checkpoint(self, out_dir: str) -> str | None:
        """Write the current policy as an HF-format folder (atomically; rank 0 writes).

        With ``lora``, the adapters are merged into the weights. Collective.
        """
        tune_state = self.full_state_dict()
        if self.rank != 0:
            return None
        if self.lora is not None:
            tune_state = merge_lora(tune_state, self.lora)
        save_hf_checkpoint(tune_state, self.model_dir, out_dir)
        return str(out_dir)

    def get_policy_version(self) -> int:
        return self.policy_version

    def get_dist_address(self) -> str:
        """``tcp://ip:port`` on this worker's node for ``init_process_group``."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def shutdown(self) -> None:
        if self.weight_sender is not None:
            self.weight_sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()
