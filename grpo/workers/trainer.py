"""The trainer: `PyTorchActorModel`, one per training worker.

Each step it gets a whole batch of `ScoredTrajectory`s (the same Ray object for every
worker), takes its share, packs it into micro-batches of at most `target_tokens_per_batch`
tokens, and accumulates gradients normalised by the whole batch's count (tokens or
sequences), so the update does not depend on how the batch was split into packs or across
workers. With several workers the model is sharded with FSDP2 (gloo on CPU, NCCL on GPU).

With ``training.lora`` the trainer trains LoRA adapters (`grpo.models.lora`) on the frozen
base model: only the adapters have optimizer state, are checkpointed (``adapter/`` and
``trainer/``) and published to the collectors, and the reference logprobs of the KL term are
the same model's with the adapters switched off.

Packing, logprobs and the loss come from `grpo.packing.packs`, `grpo.packing.logprobs` and `grpo.objective.loss`;
nothing here re-implements them.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
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
from grpo.types import GRPOStats, PackedTrajectory, ScoredTrajectory, UnscoredTrajectory
from grpo.weights.base import SendingEnd
from grpo.weights.checksum import adapter_checksum, state_dict_checksum
from grpo.weights.concurrency import TRAINER_CONCURRENCY_GROUPS
from grpo.weights.transports import sending_end
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

    FSDP2 unshards the root module's own parameters (embeddings, final norm, output
    projection) only inside the root's forward; doing the chunked output projection inside
    this forward keeps it correct when the wrapper is the FSDP root.

    Args:
        model (nn.Module): A torchtune ``TransformerDecoder``.
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

    Per layer rather than the whole model: every layer has the same code, so dynamo traces it
    once and reuses the graph for all of them, and the chunked output projection
    (`grpo.packing.logprobs`), a custom autograd function, stays out of the graph. ``Module.compile``
    keeps the parameter names, so checkpoints and weight sync see the same state dict.
    Pack lengths vary: the second length recompiles once with dynamic shapes, and later
    lengths reuse that graph.

    The attention of varlen and flex packs runs outside the compiled graphs
    (`grpo.packing.attention`): varlen splits on Python ints that differ in every pack, which would
    recompile each time, and FlexAttention is compiled on its own.

    Args:
        decoder (nn.Module): A torchtune ``TransformerDecoder``.

    Returns:
        nn.Module: ``decoder`` itself.
    """
    for layer in decoder.layers:
        layer.compile(backend="inductor", dynamic=None)
    return decoder


def _set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _loss_uses_reference(loss_fn: Any) -> bool:
    """Whether the loss has a KL term to the reference model (``kl_coeff`` above 0).

    The same rule as `RunConfig.uses_reference_model`, on the built loss: a loss class of
    your own without a ``kl_coeff`` is taken to use the reference logprobs.
    """
    kl_coeff = getattr(loss_fn, "kl_coeff", None)
    return kl_coeff is None or float(kl_coeff) > 0.0


class PyTorchActorModel:
    """One training worker; `as_remote` makes it a Ray actor class.

    Args:
        rank (int): This worker's rank.
        world_size (int): Number of training workers.
        model_dir (str): HF-format checkpoint folder of the starting policy.
        num_steps (int): Training steps of the run (sizes the LR schedule).
        target_tokens_per_batch (int): Token budget of one packed micro-batch.
        pad_token_id (int): Padding token id.
        share_prompts (bool): Pack the responses of a prompt after one copy of it, and shard
            the batch over workers by whole prompts (`grpo.packing.packs.shard_batch`).
        config (TrainingConfig | None): The ``training:`` options this actor uses: the
            ``optimizer`` node (the parameters are passed in), the ``lr_scheduler`` node (it
            receives ``optimizer`` and ``num_training_steps``), the ``loss`` node,
            ``ppo_epochs``, ``clip_grad_norm`` (null: no clipping), ``dtype``, ``mask_kind``
            (see `grpo.packing.attention`; flex has no backward on CPU), ``compile`` (see
            `compile_layers`) and ``lora`` (train low-rank adapters on the frozen base model:
            see `setup`, `adapter_state_dict` and `publish_weights`). None: their defaults.
        seed (int): Seed of model-independent randomness.
        temperature (float): The collectors' sampling temperature (``inference.temperature``):
            the policy's logprobs are those of its logits divided by it, the distribution the
            engine sampled from and whose logprobs it returned as the behaviour logprobs.
        empty_cache_after_step (bool): Give the allocator's cached GPU memory back after each
            step (``inference.sleep_while_training``: vLLM wakes on the same GPU next).
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
        # Set in `setup` once the loss is built: LoRA with a KL term computes the reference
        # logprobs here (the base model is the adapter switched off; no reference model).
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
        # Rank 0's end of the weight transport the driver uses, built by its first publish.
        self.weight_sender: SendingEnd | None = None

    @classmethod
    def as_remote(cls, **options: Any) -> Any:
        """This class as a Ray actor class.

        The weight transport's calls (`connect_weights`, `send_weights`) run in a concurrency
        group of their own (`grpo.weights.concurrency.TRAINER_CONCURRENCY_GROUPS`), beside
        training steps.

        Args:
            **options: ``ray.remote`` options (``num_cpus``, ``num_gpus``, ...).

        Returns:
            The Ray actor class; call ``.remote(...)`` with the constructor's arguments.
        """
        return ray.remote(**{"concurrency_groups": TRAINER_CONCURRENCY_GROUPS, **options})(cls)

    def setup(self, dist_init_method: str | None = None, checkpoint_dir: str | None = None) -> None:
        """Join the process group (several workers), build the model, optimizer and loss.

        Separate from ``__init__`` because rank 0's address is known only once it exists.

        Args:
            dist_init_method (str | None): ``tcp://host:port`` of rank 0; required when
                ``world_size > 1``.
            checkpoint_dir (str | None): Resume from this checkpoint: weights from its
                ``model/`` folder, then the sharded model and optimizer state, LR schedule,
                counters and RNG from ``trainer/`` (saved by any number of workers). The
                config's optimizer settings and ``num_steps`` apply from there
                (`carry_over_hyperparameters`). With ``lora`` the checkpoint has no
                ``model/``: the base model is built from ``model_dir`` and ``trainer/`` brings
                back the adapters with their optimizer state.

        With ``lora``, the adapters wrap the base model before sharding and after the seed, so
        every rank starts from the same adapter initialisation; the base weights are frozen
        and the optimizer sees only the adapters.
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
            # Draws the adapters' initial values from the RNG seeded above: identical on
            # every rank before FSDP shards them (a resume overwrites them from trainer/).
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
        # Only the adapters under LoRA: the optimizer then keeps no state for the frozen base.
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

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Write ``model/`` (HF format, from rank 0) and ``trainer/`` into ``checkpoint_dir``.

        ``trainer/`` holds the sharded model and optimizer state, each rank writing its own
        shards (`grpo.workers.training_checkpoint`), plus the LR schedule, counters and RNG.
        The caller makes the folder and renames it into place once complete, so every rank
        must see the same ``checkpoint_dir`` (a shared filesystem across nodes). Collective.

        With ``lora`` it writes ``adapter/`` (a PEFT adapter folder of the base model,
        `grpo.models.lora.save_peft_adapter`) instead of ``model/``, and ``trainer/`` holds
        only the adapters and their optimizer state: the frozen base is never rewritten.
        """
        checkpoint_dir = Path(checkpoint_dir)
        if self.lora is not None:
            # Collectors start from the base model and this adapter.
            adapter = self.adapter_state_dict()
            if self.rank == 0:
                save_peft_adapter(
                    checkpoint_dir / ADAPTER_SUBDIR,
                    peft_adapter_state_dict(adapter, self.hf_config),
                    peft_adapter_config(self.lora, self.model_dir),
                )
            del adapter
        else:
            # The exported model (collectors start from it) needs the full weights: gathered
            # (an all-gather), written by rank 0, freed before the sharded save. The optimizer
            # state is never gathered.
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
        # The config's optimizer settings run (a resume may change them, or num_steps).
        carry_over_hyperparameters(self.optimizer, self.lr_scheduler, state.get("optimizer_lr"))
        self.steps_run = state["steps_run"]
        self.policy_version = state["policy_version"]
        self.num_nonfinite_skipped = state["num_nonfinite_skipped"]
        self._nonfinite_in_a_row = state["nonfinite_in_a_row"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    # ------------------------------------------------------------------ training

    def _plan_micro_batches(
        self, batch: list[ScoredTrajectory]
    ) -> tuple[list[list[ScoredTrajectory]], int]:
        """This rank's packs, and how many micro-batches every rank must run.

        Each rank plans every rank's share (they all see the whole batch), so they agree on
        the number of forward/backward passes without communicating. With shared prompts the
        shares are whole prompt groups, balanced by tokens (`grpo.packing.packs.shard_batch`).
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

        With ``ppo_epochs > 1`` each pack first gets one forward without gradient for the
        pre-update logprobs pi_old (see `_old_logprobs`), which every epoch's loss uses for the
        correction's ratio and the mismatch metrics (``mismatch_kl``, ``mismatch_max_abs``). With
        ``lora`` and a KL term, each pack also gets a forward of the base model (adapter off)
        for the reference logprobs (see `_reference_logprobs`), and the batch's
        ``ref_logprobs`` are not used.

        Args:
            batch (list[ScoredTrajectory]): The whole batch (identical on every worker).
            time_waiting_buffer (float): Seconds the orchestrator waited for this batch.
            debug_sequence_ids (list[str] | None): Sequences whose policy logprobs (from the
                first epoch) to return under ``"debug_pi_logprobs"``, for debug tables.

        Returns:
            dict[str, float]: Metrics of the step (``train_actor_*`` names), summed over
            workers.
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
        # Normalise by the WHOLE batch's count (tokens or sequences), so gradients do not
        # depend on how the batch is split into packs or across workers.
        normalizer = self.loss_fn.batch_loss_normalizer([t.policy_len for t in batch])
        # Every real micro-batch's stats over all epochs, combined by the loss's own rule.
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
                        f"trainer[{self.rank}] got no sequences: training.batch_size must be "
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

        # A skipped step leaves weights and optimizer untouched; the driver decides when too
        # many in a row mean the run has diverged (it can then still save a checkpoint).
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
            # Below 1 only with multi-turn episodes: environment tokens are not trained.
            "train_actor_training/trained_token_fraction": (
                policy_tokens / response_tokens if response_tokens else 1.0
            ),
            names.TRAIN_POLICY_AGE_MEAN: sum(ages) / len(ages),
            names.TRAIN_POLICY_AGE_MAX: float(max(ages)),
            "train_actor_training/num_micro_batches": float(len(packs)),
            "train_actor_training/nonfinite_steps_skipped": float(self.num_nonfinite_skipped),
            names.TRAIN_NONFINITE_STEPS_IN_A_ROW: float(self._nonfinite_in_a_row),
            names.TRAIN_PERF_TOTAL_STEP_TIME: (
                time.perf_counter() - step_start + time_waiting_buffer
            ),
            names.TRAIN_PERF_TIME_GRPO_STEPS: time_grpo_steps,
            # Everything this call computed (packing, forward, backward, optimizer, the
            # metric reduction); the driver's step breakdown subtracts it from its wall time.
            names.TRAIN_PERF_TIME_TRAIN_COMPUTE: time.perf_counter() - step_start,
            names.TRAIN_PERF_TIME_WAITING_BUFFER: time_waiting_buffer,
            names.TRAIN_PERF_TOKENS_PER_SECOND: (
                response_tokens * self.ppo_epochs / time_grpo_steps if time_grpo_steps else 0.0
            ),
            names.TRAIN_PERF_PADDED_TOKENS_PERCENTAGE: (
                100.0 * (packed_tokens - real_tokens) / packed_tokens if packed_tokens else 0.0
            ),
            # Share of this worker's sequence tokens (prompts repeated) that shared prompts
            # left out of the forward and backward passes.
            names.TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED: (
                100.0 * shared_tokens / (real_tokens + shared_tokens) if real_tokens else 0.0
            ),
        }
        if self.computes_reference:
            # Part of time_grpo_steps: the base model's forwards (adapter off) in this trainer.
            metrics["train_actor_performance/time_reference_forward"] = time_reference
        if wanted:
            metrics["debug_pi_logprobs"] = debug_pi_logprobs
        if self.empty_cache_after_step and self.device.type == "cuda":
            # The allocator keeps the step's peak reserved; vLLM wakes on the same GPU next.
            torch.cuda.empty_cache()
        return metrics

    def _old_logprobs(
        self, packs: list[PackedTrajectory], num_micro_batches: int
    ) -> list[torch.Tensor | None]:
        """pi_old of each pack: the trainer's logprobs before this step's first update.

        With one epoch the first (and only) forward sees the pre-update weights, so the loss
        takes pi_old from it (None here: no extra forward). With more epochs the weights
        change between epochs, so one forward without gradient per pack fixes pi_old first;
        the loss uses it for the correction's ratio and the mismatch metrics in every epoch.

        Args:
            packs (list[PackedTrajectory]): This rank's packs.
            num_micro_batches (int): Micro-batches every rank runs; a rank with fewer packs
                runs filler forwards so that FSDP's collectives line up across ranks.

        Returns:
            list[torch.Tensor | None]: One entry per pack.
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
        """The reference logprobs of each pack: the batch's, or the base model's under LoRA.

        With ``lora`` and a loss with a KL term, the reference model is the base model this
        trainer already holds: the same forward as the policy's (temperature applied), without
        gradient and with every adapter switched off (torchtune's ``disable_adapter``). Under
        FSDP each forward gathers parameters, so every rank runs ``num_micro_batches`` of them
        (a rank with fewer packs repeats one). They are computed in the training dtype.
        Otherwise each pack's own ``ref_logprobs`` (from the reference actor; None without a
        KL term).

        Args:
            packs (list[PackedTrajectory]): This rank's packs.
            num_micro_batches (int): Micro-batches every rank runs.

        Returns:
            list[torch.Tensor | None]: One entry per pack.
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
        """The step's loss metrics over every micro-batch, epoch and rank.

        `combine_stats` gives this rank's exact values; across ranks, loss parts are weighted
        by each rank's share of the normaliser and token means by its tokens, so the result is
        the same however the batch was split.
        """
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
            f"train_actor_training/{name}": total[name] / count
            for name in ("loss", "policy_loss", "kl_loss")
        }
        for name in ("ratios", "clipfrac", "approx_policy_kls", "kl_to_ref", "mismatch_kl"):
            metrics[f"train_actor_training/{name}"] = total[name] / tokens
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

    # ------------------------------------------------------------------ weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights in torchtune names, on CPU.

        Collective: with several workers every rank must call it. With ``lora``, the base
        weights and the adapters (``lora_a`` / ``lora_b``), unmerged.
        """
        return self._gathered(lambda name: True)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) LoRA adapter tensors in torchtune names, on CPU.

        Only the adapters are gathered, never the base. Collective: with several workers
        every rank must call it.

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
        """What the collectors receive, under the names they load: the full weights in HF
        names, or with ``lora`` only the adapter tensors in PEFT names.

        Collective (the gather); renamed on rank 0 only, None on the other ranks.
        """
        if self.lora is not None:
            adapter = self.adapter_state_dict()
            return peft_adapter_state_dict(adapter, self.hf_config) if self.rank == 0 else None
        tune_state = self.full_state_dict()
        return tune_to_hf_state_dict(tune_state, self.hf_config) if self.rank == 0 else None

    @torch.no_grad()
    def probe_logprobs(self) -> dict[str, Any]:
        """Logprobs of a fixed token sequence under the current weights.

        A collector that loaded the same weights must reproduce them, which proves that the
        engine computes with what was sent, not only that the bytes arrived. Collective.
        """
        vocab_size = int(self.hf_config["vocab_size"])
        token_ids = [(7 * i + 3) % min(vocab_size, 256) for i in range(16)]
        probe = UnscoredTrajectory(
            prompt_tokens=torch.tensor(token_ids[:1]),
            response_tokens=torch.tensor(token_ids[1:]),
            prompt_len=1,
            response_len=len(token_ids) - 1,
            logprobs=torch.zeros(len(token_ids) - 1),
            answer="",
            sequence_id="weight-sync-probe",
            policy_version=self.policy_version,
            group_id=-1,
        )
        packed = pack_sequences([probe], self.device, self.pad_token_id)
        # Temperature 1: the engine scores the probe with prompt logprobs, which are always
        # those of the unscaled logits.
        logprobs = self.policy(packed).float().cpu().tolist()
        # fp32 on both sides agrees to ~1e-5; bf16 rounding differs between kernels.
        atol = 1e-3 if self.dtype == torch.float32 else 0.1
        return {"token_ids": token_ids, "logprobs": logprobs, "atol": atol}

    def publish_weights(self, transport: str) -> dict[str, Any] | None:
        """Gather the full weights and publish them (rank 0), as version ``steps_run``.

        A policy version is the number of training steps the weights have taken (0: the base
        model), so the staleness of a trajectory, its version against the trainer's step
        count, is counted in steps whatever ``weight_sync.every_n_steps`` is.

        With ``lora`` only the adapter tensors are gathered and published, in PEFT names
        (`grpo.models.lora.peft_adapter_state_dict`); the payload is otherwise the same, its
        probe that of the model with the adapter on (what the collectors serve).

        Collective: every rank must call it (the gather and the probe forward are).

        Args:
            transport (str): The transport the driver uses (``weight_sync.transport``).

        Returns:
            dict | None: On rank 0, the payload ``{"version", "checksum", "probe",
            "weights"}``: ``weights`` is what the transport's sending end made of them
            (`grpo.weights.base.SendingEnd.publish`), the checksum the one both ends compute,
            the probe the logprobs the collectors reproduce. None on the other ranks.
        """
        weights = self._published_weights()
        probe = self.probe_logprobs()
        self.policy_version = self.steps_run
        if weights is None:  # not rank 0
            return None
        if self.weight_sender is None:
            self.weight_sender = sending_end(transport, f"trainer[{self.rank}]", self.device.type)
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
        """Checksum of the current weights, in the same definition the collectors use.

        With ``lora``, that of the PEFT-named adapter tensors (what `publish_weights` sends),
        or `NO_ADAPTER_CHECKSUM` while every B is zero: such an adapter is the base model, which
        is what a collector serves before its first adapter. Collective.
        """
        weights = self._published_weights()
        if weights is None:
            return None
        return adapter_checksum(weights) if self.lora is not None else state_dict_checksum(weights)

    def save_hf_checkpoint(self, out_dir: str) -> str | None:
        """Write the current policy as an HF-format folder (atomically; rank 0 writes).

        With ``lora``, the base model with the adapters merged into its weights
        (`grpo.models.lora.merge_lora`): a plain model folder, served without LoRA. Collective.
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
