"""The GPU memory a run will need, per role and per device, before anything starts.

``grpo validate`` prints this plan and refuses a placement that cannot fit its GPUs. It is
computed from the config and the model's ``config.json`` alone: no model is built. Weights,
gradients and optimizer state are exact; activations, logits and CUDA contexts are estimates.

Placement follows Ray's: actors start in the order ref, inference, training; one asking for a
GPU or more gets whole devices of its own, fractional ones are packed first-fit onto shared
devices. The roles on one device add up. With ``inference.sleep_while_training`` a shared
device needs the larger of generation (vLLM's share beside the trainer's weights, gradients
and optimizer state) and training (the trainer's peak beside vLLM's CUDA context).

Example:
    >>> plan = memory_plan(cfg, load_hf_config(cfg.base_model_path), gpu_memory=24 * GiB)
    >>> print(format_memory_plan(plan))
    >>> memory_problems(plan)  # one line per role that cannot fit, naming a key
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo.choices import LORA_TARGETS
from grpo.config import LoRAConfig, RunConfig
from grpo.config.run import ROLES
from grpo.preflight.files import model_config_file

GiB = 2**30

# Bytes per element of the dtype names the config and vLLM's engine_args take.
DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
}

# grpo.packing.logprobs.DEFAULT_CHUNK_SIZE (a test holds them equal): response tokens whose
# logits exist at once. Not imported: that module imports torch.
LOGITS_CHUNK_TOKENS = 512

# What a process's CUDA context and its kernels take on a device besides the allocator's
# memory: an estimate (scripts and drivers vary; about 0.75 GiB with torch 2.11 on Hopper).
CUDA_CONTEXT_BYTES = 3 * GiB // 4

# vLLM's default gpu_memory_utilization.
VLLM_DEFAULT_UTILIZATION = 0.9

# The roles' names (each the config section that places it) in start order, from the one
# table of placed roles (`grpo.config.run.ROLES`).
ROLE_NAMES = tuple(role.name for role in ROLES)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that memory depends on, read from its ``config.json``."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_dim

    def linear_dims(self, target: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a linear layer, by its Hugging Face name."""
        return {
            "q_proj": (self.hidden, self.q_dim),
            "k_proj": (self.hidden, self.kv_dim),
            "v_proj": (self.hidden, self.kv_dim),
            "o_proj": (self.q_dim, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[target]


def model_shape(hf_config: dict[str, Any]) -> ModelShape:
    """The `ModelShape` of a Qwen2, Qwen3 or Llama ``config.json``, as `grpo.models` builds it.

    Raises:
        ValueError: If a size is missing, naming it.
    """

    def need(key: str) -> int:
        if not isinstance(hf_config.get(key), int):
            raise ValueError(f"config.json has no {key!r}")
        return int(hf_config[key])

    model_type = str(hf_config.get("model_type"))
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    # Qwen3 has an explicit head_dim; the torchtune Qwen2 and Llama builders derive it.
    head_dim = int(hf_config.get("head_dim") or hidden // heads) if model_type == "qwen3" else 0
    return ModelShape(
        model_type=model_type,
        hidden=hidden,
        intermediate=need("intermediate_size"),
        layers=need("num_hidden_layers"),
        heads=heads,
        kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        head_dim=head_dim or hidden // heads,
        vocab=need("vocab_size"),
        tied=bool(hf_config.get("tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a decoder, by part, and how many tensors hold them.

    Attributes:
        embedding (int): The token embedding.
        output (int): The output projection; 0 when tied to the embedding.
        attention (int): q/k/v/o of every layer, with Qwen2's q/k/v biases and Qwen3's
            per-head q/k norms.
        mlp (int): gate/up/down of every layer.
        norms (int): The two norms of every layer and the final norm.
        tensors (int): Parameter tensors (AdamW keeps a ``step`` for each).
        per_layer (int): Parameters of one decoder layer.
        layers (int): Decoder layers.
    """

    embedding: int
    output: int
    attention: int
    mlp: int
    norms: int
    tensors: int
    per_layer: int
    layers: int

    @property
    def total(self) -> int:
        """Every parameter."""
        return self.embedding + self.output + self.attention + self.mlp + self.norms

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers (embedding, output, final norm)."""
        return self.total - self.per_layer * self.layers


def parameter_count(shape: ModelShape) -> ParameterCount:
    """The exact parameter count of the torchtune decoder `grpo.models.build_model` builds.

    Returns:
        ParameterCount: By part; the output projection counts 0 when
        ``tie_word_embeddings`` (torchtune's ``TiedLinear`` reuses the embedding).
    """
    d, layers = shape.hidden, shape.layers
    attention = d * shape.q_dim + 2 * d * shape.kv_dim + shape.q_dim * d
    attention_tensors = 4
    if shape.model_type == "qwen2":  # q, k and v have biases
        attention += shape.q_dim + 2 * shape.kv_dim
        attention_tensors += 3
    elif shape.model_type == "qwen3":  # an RMSNorm over each query and key head
        attention += 2 * shape.head_dim
        attention_tensors += 2
    mlp = 3 * d * shape.intermediate
    layer_norms = 2 * d
    per_layer = attention + mlp + layer_norms
    output = 0 if shape.tied else shape.vocab * d
    return ParameterCount(
        embedding=shape.vocab * d,
        output=output,
        attention=attention * layers,
        mlp=mlp * layers,
        norms=layer_norms * layers + d,
        tensors=(attention_tensors + 3 + 2) * layers + 2 + (0 if shape.tied else 1),
        per_layer=per_layer,
        layers=layers,
    )


def lora_parameter_count(shape: ModelShape, lora: LoRAConfig) -> tuple[int, int]:
    """Adapter parameters and tensors: rank x (in + out) per target per layer, A and B each.

    Returns:
        tuple[int, int]: ``(parameters, tensors)``.
    """
    per_layer = sum(lora.rank * sum(shape.linear_dims(t)) for t in set(lora.target_modules))
    return per_layer * shape.layers, 2 * len(set(lora.target_modules)) * shape.layers


@dataclass(frozen=True)
class Part:
    """One share of a role's memory.

    Attributes:
        name (str): What it is, e.g. ``"optimizer state"``.
        nbytes (int): Its size in bytes.
        exact (bool): Computed exactly from the sizes (weights, gradients, optimizer state),
            or an estimate (activations, logits, working sets, CUDA context).
        resident (bool): Held between steps; False for what exists only while the role
            computes (activations, logits), which a sleeping vLLM's memory can take in turn.
    """

    name: str
    nbytes: int
    exact: bool = True
    resident: bool = True


@dataclass(frozen=True)
class RoleMemory:
    """What one actor of a role needs on one device.

    Attributes:
        role (str): ``"inference"``, ``"ref"`` or ``"training"`` (its config section).
        key (str): The key that sizes it most, named in a refusal (see `memory_problems`).
        parts (tuple[Part, ...]): Its memory, part by part.
        device_fraction (float): vLLM's ``gpu_memory_utilization``: this fraction of the whole
            device on top of ``parts`` (whose ``resident`` parts then only say what it holds).
        asleep_bytes (int | None): With ``inference.sleep_while_training``: what vLLM keeps
            on the device while it sleeps; None: it never sleeps.
        min_bytes (int): Least memory the role can work in (vLLM: its weights and the KV cache
            of one longest sequence, which must fit inside its share).
        advice (str): What else helps when it does not fit, after the key's name.
    """

    role: str
    key: str
    parts: tuple[Part, ...]
    device_fraction: float = 0.0
    asleep_bytes: int | None = None
    min_bytes: int = 0
    advice: str = ""

    def total(self, capacity: int | None) -> int | None:
        """Bytes needed at its peak on a device of ``capacity`` bytes (None: unknown)."""
        if self.device_fraction:
            return None if capacity is None else int(self.device_fraction * capacity)
        return sum(part.nbytes for part in self.parts)

    def resident(self, capacity: int | None) -> int | None:
        """Bytes held between its compute phases (weights, gradients, optimizer state)."""
        if self.device_fraction:
            return self.total(capacity)
        return sum(part.nbytes for part in self.parts if part.resident)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``bf16``, ``float32``, ...).

    Raises:
        ValueError: For a name not in `DTYPE_BYTES`.
    """
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def optimizer_moments(node: dict[str, Any]) -> tuple[int, bool, bool]:
    """State tensors per parameter the optimizer node keeps, whether it keeps a per-tensor
    ``step``, and whether that is known (Adam, AdamW, SGD) or assumed (Adam's, for others).
    """
    name = str(node.get("_component_", "")).rsplit(".", 1)[-1]
    if name in ("Adam", "AdamW"):
        return 2 + bool(node.get("amsgrad", False)), True, True
    if name == "SGD":
        return int(float(node.get("momentum", 0) or 0) > 0), False, True
    return 2, True, False


def trainer_memory(cfg: RunConfig, shape: ModelShape) -> RoleMemory:
    """One trainer's memory on its device (`trainer_parts`), keyed for a refusal."""
    parts = trainer_parts(cfg, shape)
    by_name = {part.name: part.nbytes for part in parts}
    activations = by_name.get("activations", 0) + by_name.get("logits", 0)
    # Name the lever of the largest share: the micro-batch, or the sharding of the state.
    if activations >= sum(by_name.values()) / 2:
        key, advice = "target_tokens_per_batch", "lower it (activations grow with it)"
    else:
        key, advice = "orchestration.num_training_workers", "shard over more trainers"
    if cfg.training.lora is None:
        advice += ", or set training.lora"
    if cfg.training.dtype in ("fp32", "float32"):
        advice += ", or training.dtype=bf16"
    return RoleMemory("training", key, parts, advice=advice)


def trainer_parts(cfg: RunConfig, shape: ModelShape) -> tuple[Part, ...]:
    """The trainer's weights, gradients, optimizer state, activations and logits.

    Weights, gradients and optimizer state are exact (divided by the number of trainers under
    FSDP, rounded up); the rest are estimates (see `activation_bytes`).
    """
    training = cfg.training
    size = dtype_bytes(training.dtype)
    params = parameter_count(shape)
    workers = cfg.orchestration.num_training_workers
    moments, has_step, known = optimizer_moments(dict(training.optimizer))
    if training.lora is None:
        trained, trained_tensors = params.total, params.tensors
    else:
        trained, trained_tensors = lora_parameter_count(shape, training.lora)
    weights = (params.total + (trained if training.lora else 0)) * size
    gradients = trained * size
    optimizer = moments * trained * size + (4 * trained_tensors if has_step else 0)
    parts = [
        Part("weights", math.ceil(weights / workers)),
        Part("gradients", math.ceil(gradients / workers)),
        Part("optimizer state", math.ceil(optimizer / workers), exact=known),
    ]
    if workers > 1:
        # FSDP2 unshards the root (embedding, output, final norm) for the whole forward and
        # prefetches the next layer while one runs.
        gathered = (params.root + 2 * params.per_layer) * size
        parts.append(Part("FSDP all-gather", gathered, exact=False, resident=False))
    tokens = cfg.target_tokens_per_batch
    parts += [
        Part("activations", activation_bytes(shape, tokens, size, training.lora), False, False),
        Part("logits", logits_bytes(shape, tokens, size), exact=False, resident=False),
        Part("CUDA context", CUDA_CONTEXT_BYTES, exact=False),
    ]
    return tuple(parts)


def activation_bytes(
    shape: ModelShape, tokens: int, size: int, lora: LoRAConfig | None = None
) -> int:
    """Estimated bytes autograd saves for backward in one micro-batch of ``tokens`` tokens.

    Assumes flex or varlen attention and no activation checkpointing; keys and values count
    expanded to every query head, as torchtune does for grouped-query attention.

    Args:
        size (int): Bytes per element of the parameter dtype.
        lora (LoRAConfig | None): The adapters, when only they train.
    """
    d, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    targets = set(lora.target_modules) if lora else set(LORA_TARGETS)
    # torchtune's RMSNorm normalises in fp32 with a scale in the parameter dtype: below fp32
    # the dtypes differ, torch cannot use its fused kernel, and the decomposed norm also
    # keeps its fp32 normalised output for the scale's gradient (when the scale trains).
    norm = 4 + (4 if size != 4 and lora is None else 0)  # bytes per normalised element
    per_layer = 2 * (norm * d + 4)  # two RMSNorms: fp32 input (and output), inverse RMS
    per_layer += 4 * shape.head_dim * size  # RoPE's cos and sin, for queries and for keys
    per_layer += 4 * q * size + 4 * shape.heads  # q, expanded k and v, output; log-sum-exp
    per_layer += 3 * i * size  # gate and up outputs, SiLU output
    if shape.model_type == "qwen3":  # per-head q/k norms, as the layer norms
        per_layer += norm * (q + kv) + 4 * (shape.heads + shape.kv_heads)
    # A linear layer keeps its input only to compute its weight's (or adapter's) gradient.
    inputs = {
        "q_proj": ("attn_in", d),
        "k_proj": ("attn_in", d),
        "v_proj": ("attn_in", d),
        "o_proj": ("o_in", q),
        "gate_proj": ("mlp_in", d),
        "up_proj": ("mlp_in", d),
        "down_proj": ("down_in", i),
    }
    per_layer += size * sum(dict(inputs[t] for t in targets).values())
    if lora is not None:
        per_layer += size * lora.rank * len(targets)  # each adapter's A output (no dropout)
    head = norm * d + 4 + size * d + 8  # final norm; response rows; token ids
    return tokens * (shape.layers * per_layer + head)


def logits_bytes(shape: ModelShape, tokens: int, size: int) -> int:
    """Estimated peak of the chunked logprob computation (`grpo.packing.logprobs`).

    Logits never exist for the whole micro-batch: `LOGITS_CHUNK_TOKENS` rows at a time, as
    the projection's output in the parameter dtype, its fp32 copy and the softmax (fp32).
    """
    return min(tokens, LOGITS_CHUNK_TOKENS) * shape.vocab * (size + 8)


def reference_memory(
    cfg: RunConfig, shape: ModelShape, teacher_shape: ModelShape | None = None
) -> RoleMemory | None:
    """One reference actor's memory, or None when it loads no model.

    It loads the reference model when the loss has a KL term and no LoRA (then the trainer
    computes the reference logprobs), and the distillation teacher whenever one is configured.
    The two forwards run one after the other, so the working set is the larger of them.

    Args:
        teacher_shape (ModelShape | None): The teacher's, from its ``config.json``; needed
            when ``ref.teacher_model_path`` is set.

    Raises:
        ValueError: If a teacher is configured and ``teacher_shape`` is None.
    """
    loads_reference = cfg.uses_reference_model() and cfg.training.lora is None
    has_teacher = cfg.ref.teacher_model_path is not None
    if has_teacher and teacher_shape is None:
        raise ValueError("reference_memory: ref.teacher_model_path is set: give teacher_shape")
    if not loads_reference and not has_teacher:
        return None
    tokens = cfg.target_tokens_per_batch
    weights, forwards, advice = [], [], []
    for name, model, dtype, key in (
        ("weights", shape, cfg.ref.dtype, "ref.dtype"),
        ("teacher weights", teacher_shape, cfg.ref.teacher_dtype, "ref.teacher_dtype"),
    ):
        if model is None or (name == "weights" and not loads_reference):
            continue
        size = dtype_bytes(dtype)
        weights.append(Part(name, parameter_count(model).total * size))
        forwards.append(_no_grad_forward_bytes(model, tokens, size))
        if size == 4:
            advice.append(f"{key}=bf16")
    parts = (
        *weights,
        Part("forward", max(forwards), exact=False, resident=False),
        Part("CUDA context", CUDA_CONTEXT_BYTES, exact=False),
    )
    advice_text = "give it a larger GPU" + "".join(f", or {item}" for item in advice)
    return RoleMemory("ref", "ref.num_gpus", parts, advice=advice_text)


def _no_grad_forward_bytes(shape: ModelShape, tokens: int, size: int) -> int:
    """Estimated working set of a no-grad forward of ``tokens`` tokens (reference, teacher)."""
    # A no-grad forward frees each layer's tensors as it goes: the residual stream and its
    # normed copy, then the larger of attention's tensors and the MLP's.
    widest = max(3 * shape.intermediate, 4 * shape.q_dim + 2 * shape.kv_dim)
    return tokens * size * (2 * shape.hidden + widest) + logits_bytes(shape, tokens, size)


def collector_memory(cfg: RunConfig, shape: ModelShape, hf_config: dict[str, Any]) -> RoleMemory:
    """One collector's vLLM engine on one of its devices.

    vLLM takes ``gpu_memory_utilization`` of the whole device, whatever else runs there; with
    ``kv_cache_memory_bytes``, its weights plus that cache instead.
    """
    engine = cfg.inference.engine_args
    size = _engine_dtype_bytes(engine.get("dtype", "auto"))
    tp = max(1, int(engine.get("tensor_parallel_size") or 1))
    weights = math.ceil(parameter_count(shape).total * size / tp)
    max_len = int(engine.get("max_model_len") or hf_config.get("max_position_embeddings") or 0)
    kv_size = _engine_dtype_bytes(engine.get("kv_cache_dtype", "auto"), auto=size)
    # Keys and values of every layer, kv heads split over the tensor-parallel ranks.
    one_sequence = math.ceil(max_len * 2 * shape.layers * shape.kv_dim * kv_size / tp)
    asleep = CUDA_CONTEXT_BYTES if cfg.inference.sleep_while_training else None
    kv_bytes = engine.get("kv_cache_memory_bytes")
    if kv_bytes is not None:
        parts = (
            Part("weights", weights),
            Part("KV cache", int(kv_bytes)),
            Part("CUDA context", CUDA_CONTEXT_BYTES, exact=False),
        )
        key = "inference.engine_args.kv_cache_memory_bytes"
        return RoleMemory(
            "inference", key, parts, asleep_bytes=asleep, min_bytes=weights, advice="lower it"
        )
    utilization = float(engine.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    parts = (Part("weights", weights), Part("KV cache of one longest sequence", one_sequence))
    key = "inference.engine_args.gpu_memory_utilization"
    return RoleMemory(
        "inference",
        key,
        parts,
        device_fraction=utilization,
        asleep_bytes=asleep,
        min_bytes=weights + one_sequence,
        advice="raise it, or use GPUs with more memory",
    )


def _engine_dtype_bytes(name: Any, auto: int = 2) -> int:
    """Bytes per element of a vLLM dtype; ``auto`` for weights: 16 bits (vLLM serves a
    checkpoint in its own 16-bit dtype, and an fp32 one in 16 bits on GPUs)."""
    if name == "auto" or name is None:
        return auto
    return dtype_bytes(str(name))


@dataclass(frozen=True)
class Placement:
    """One actor on one device: ``label`` (its name, ``"inference[1]"``), its memory, its GPU
    share."""

    label: str
    memory: RoleMemory
    share: float


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU of the plan and the actors on it.

    Attributes:
        index (int): Its number in the plan (not a CUDA device id: Ray picks those).
        capacity (int | None): Its memory in bytes; None when unknown (no GPU, no flag).
        actors (tuple[Placement, ...]): What runs on it.
    """

    index: int
    capacity: int | None
    actors: tuple[Placement, ...]

    def need(self) -> int | None:
        """Peak bytes of the actors together (the sleep rule of the module docstring); None
        when a vLLM share is a fraction of an unknown capacity."""
        sleeping = [p for p in self.actors if p.memory.asleep_bytes is not None]
        awake = [self.actors_total(p, resident=False) for p in self.actors]
        if None in awake:
            return None
        if not sleeping or not any(p.memory.role == "training" for p in self.actors):
            return sum(awake)
        # Generation: vLLM awake beside the trainer's resident state. Training: vLLM asleep.
        generating = sum(
            self.actors_total(p, resident=p.memory.role == "training") for p in self.actors
        )
        training = sum(
            p.memory.asleep_bytes if p in sleeping else self.actors_total(p, resident=False)
            for p in self.actors
        )
        return max(generating, training)

    def actors_total(self, placement: Placement, resident: bool) -> int | None:
        """One actor's bytes here: at its peak, or only its resident parts."""
        memory = placement.memory
        return memory.resident(self.capacity) if resident else memory.total(self.capacity)


@dataclass(frozen=True)
class MemoryPlan:
    """The GPU memory of a run: each role's needs and the devices they land on.

    Attributes:
        roles (dict[str, RoleMemory | None]): By role; None for a reference actor with no
            model.
        on_cpu (tuple[str, ...]): Roles whose actors ask for no GPU (not planned).
        devices (tuple[DeviceMemory, ...]): The GPUs, in placement order.
        capacity_source (str): Where the capacity comes from (``--gpu-memory``, torch's
            device name, ``"no GPU here"`` or ``"given"``).
    """

    roles: dict[str, RoleMemory | None]
    on_cpu: tuple[str, ...]
    devices: tuple[DeviceMemory, ...]
    capacity_source: str


def memory_plan(
    cfg: RunConfig,
    hf_config: dict[str, Any],
    gpu_memory: int | None = None,
    capacity_source: str = "given",
    teacher_hf_config: dict[str, Any] | None = None,
) -> MemoryPlan:
    """Place every actor of a run on GPUs and total what each device needs.

    Args:
        gpu_memory (int | None): Bytes of each GPU; None when unknown (the plan then has no
            capacities, and vLLM's share stays a fraction).
        capacity_source (str): Where ``gpu_memory`` comes from, for the printout.
        teacher_hf_config (dict[str, Any] | None): The distillation teacher's parsed
            ``config.json``; needed when ``ref.teacher_model_path`` is set.

    Raises:
        ValueError: If a ``config.json`` lacks a size the plan needs, or a teacher is
            configured without ``teacher_hf_config``.
    """
    shape = model_shape(hf_config)
    teacher_shape = None if teacher_hf_config is None else model_shape(teacher_hf_config)
    roles: dict[str, RoleMemory | None] = {
        "ref": reference_memory(cfg, shape, teacher_shape),
        "inference": collector_memory(cfg, shape, hf_config),
        "training": trainer_memory(cfg, shape),
    }
    counts = {role.name: getattr(cfg.orchestration, role.count_key) for role in ROLES}
    gpus = {role.name: getattr(cfg, role.name).num_gpus for role in ROLES}
    tp = max(1, int(cfg.inference.engine_args.get("tensor_parallel_size") or 1))
    whole: list[list[Placement]] = []
    shared: list[list[Placement]] = []  # devices of fractional actors
    for role in ROLE_NAMES:
        memory, share = roles[role], gpus[role]
        if share == 0:
            continue
        for index in range(counts[role]):
            label = f"{role}[{index}]"
            if memory is None:  # a reference actor without a model still takes its GPU share
                memory = RoleMemory(role, f"{role}.num_gpus", ())
            if share >= 1:
                devices = math.ceil(share)
                # vLLM spreads over its tensor-parallel ranks; the others use one device.
                used = min(devices, tp) if role == "inference" else 1
                for device in range(devices):
                    on_it = [Placement(label, memory, 1.0)] if device < used else []
                    whole.append(on_it)
                continue
            # First fit, as Ray packs fractional GPU requests onto one GPU.
            fits = [on for on in shared if sum(p.share for p in on) + share <= 1 + 1e-9]
            if fits:
                fits[0].append(Placement(label, memory, share))
            else:
                shared.append([Placement(label, memory, share)])
    placed = [*whole, *shared]
    devices = tuple(
        DeviceMemory(index, gpu_memory, tuple(actors)) for index, actors in enumerate(placed)
    )
    on_cpu = tuple(role for role in ROLE_NAMES if gpus[role] == 0)
    return MemoryPlan(roles, on_cpu, devices, capacity_source)


def memory_problems(plan: MemoryPlan) -> list[str]:
    """One line per role whose device cannot hold what is placed on it.

    Each line starts with the key to change (`RoleMemory.key`; a role that fits alone but not
    beside the others names its ``num_gpus``). Nothing is checked where the capacity is unknown.

    Returns:
        list[str]: The lines, in role start order; empty when everything fits.
    """
    found: dict[str, str] = {}
    for device in plan.devices:
        if device.capacity is None:
            continue
        alone = {p.memory.role: _alone_problem(p.memory, device) for p in device.actors}
        alone = {role: line for role, line in alone.items() if line}
        for role, line in alone.items():
            found.setdefault(role, line)
        need = device.need()
        if alone or need is None or need <= device.capacity:
            continue
        sleeps = any(p.memory.asleep_bytes is not None for p in device.actors)
        sleep_advice = "" if sleeps else ", or set inference.sleep_while_training"
        for placement in device.actors:
            memory = placement.memory
            others = " and ".join(
                f"{other.label} ({_size(device.actors_total(other, resident=False))})"
                for other in device.actors
                if other.label != placement.label
            )
            key = memory.key if memory.device_fraction else f"{memory.role}.num_gpus"
            found.setdefault(
                memory.role,
                f"{key}: GPU {device.index} cannot hold the {memory.role} actor "
                f"({_size(memory.total(device.capacity))}) beside {others}: {_size(need)} in "
                f"all, and it has {_size(device.capacity)}; give the roles GPUs of their own, "
                f"or lower inference.engine_args.gpu_memory_utilization{sleep_advice}",
            )
    return [found[role] for role in ROLE_NAMES if role in found]


def _alone_problem(memory: RoleMemory, device: DeviceMemory) -> str | None:
    """Why one role cannot fit its device even alone, or None."""
    capacity = device.capacity
    assert capacity is not None
    if memory.device_fraction:
        share = memory.device_fraction * capacity
        if memory.min_bytes <= share:
            return None
        return (
            f"{memory.key}: the {memory.role} actor's vLLM share of GPU {device.index} "
            f"({memory.device_fraction:g} x {_size(capacity)} = {_size(share)}) cannot hold its "
            f"{_parts_text(memory.parts)}; {memory.advice}"
        )
    need = memory.total(capacity) or 0
    if need <= capacity:
        return None
    return (
        f"{memory.key}: the {memory.role} actor needs {_size(need)} on GPU {device.index} "
        f"({_parts_text(memory.parts)}) but it has {_size(capacity)}"
        f"{'; ' + memory.advice if memory.advice else ''}"
    )


def format_memory_plan(plan: MemoryPlan) -> str:
    """The plan as lines for the terminal: per device, each actor and its parts.

    Estimates are marked ``~``; sizes in GiB (2^30 bytes) or MiB (2^20).
    """
    capacity = plan.devices[0].capacity if plan.devices else None
    if capacity:
        size = f"{_size(capacity)} each, {plan.capacity_source}"
    else:  # nothing to check against: --gpu-memory names a size
        size = f"size unknown ({plan.capacity_source}; nothing checked)"
    lines = [f"GPU memory plan ({len(plan.devices)} GPUs, {size}; ~ marks an estimate):"]
    for device in plan.devices:
        need = device.need()
        total = "?" if need is None else _size(need)
        of = f" of {_size(device.capacity)}" if device.capacity else ""
        lines.append(f"  GPU {device.index}: {total}{of}")
        for placement in device.actors:
            text = _role_text(placement, device.capacity)
            lines += _wrapped(f"    {placement.label:<12} ", text, indent=17)
        if not device.actors:
            lines.append("    (unused: a tensor-parallel slot or an actor's extra GPU)")
    if plan.roles["ref"] is None:
        lines.append(
            "  ref: no model (no KL term, or LoRA: the training actor computes it; no teacher)"
        )
    for role in plan.on_cpu:
        lines.append(f"  {role}: on CPU ({role}.num_gpus 0), not planned")
    return "\n".join(lines)


def _role_text(placement: Placement, capacity: int | None) -> str:
    memory = placement.memory
    share = f"[{placement.share:g} GPU] " if placement.share < 1 else ""
    if not memory.parts:
        return f"{share}nothing (loads no model)"
    if memory.device_fraction:
        total = memory.total(capacity)
        amount = f"{_size(total)} = " if total is not None else ""
        text = (
            f"{amount}{memory.device_fraction:g} of the GPU (gpu_memory_utilization), holding "
            f"{_parts_text(memory.parts)}"
        )
    else:
        text = f"{_size(memory.total(capacity) or 0)}: {_parts_text(memory.parts)}"
    if memory.asleep_bytes is not None:
        text += f"; asleep while training: ~{_size(memory.asleep_bytes)}"
    return share + text


def _wrapped(first: str, text: str, indent: int, width: int = 100) -> list[str]:
    """``first + text`` as lines of at most ``width`` characters, broken before a `` + ``."""
    pieces = text.split(" + ")
    lines, line = [], first + pieces[0]
    for piece in pieces[1:]:
        if len(line) + len(" + ") + len(piece) > width:
            lines.append(line)
            line = " " * indent + "+ " + piece
        else:
            line += " + " + piece
    return [*lines, line]


def _parts_text(parts: Sequence[Part]) -> str:
    return " + ".join(
        f"{part.name} {'' if part.exact else '~'}{_size(part.nbytes)}" for part in parts
    )


def _size(nbytes: float | None) -> str:
    """Bytes as GiB (2^30), or MiB below one GiB; ``?`` for unknown."""
    if nbytes is None:
        return "?"
    if nbytes < GiB:
        return f"{nbytes / 2**20:.0f} MiB"
    value = nbytes / GiB
    return f"{value:.2f} GiB" if value < 10 else f"{value:.1f} GiB"


def parse_size(text: str) -> int:
    """Bytes of a size such as ``24GiB``, ``80GB`` or ``512MiB`` (GB = 10^9, GiB = 2^30).

    Raises:
        ValueError: For anything else, with an example.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"expected a size such as 24GiB or 80GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def local_gpu_memory() -> tuple[int, str] | None:
    """The memory of this machine's smallest GPU and its name, or None without CUDA GPUs.

    Imports torch (only ``grpo validate`` of a config that places a role on a GPU calls it).
    """
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    smallest = min(devices, key=lambda props: props.total_memory)
    return int(smallest.total_memory), f"{smallest.name} (torch)"


def run_memory_plan(cfg: RunConfig, gpu_memory: int | None = None) -> MemoryPlan | None:
    """The plan ``grpo validate`` prints: the config's model, on GPUs of ``gpu_memory`` bytes.

    Args:
        gpu_memory (int | None): Bytes of each GPU (``--gpu-memory``); None: this machine's
            smallest GPU, or no capacity (nothing checked) on a machine without one.

    Returns:
        MemoryPlan | None: None when no role asks for a GPU.

    Raises:
        ValueError: If there is no ``config.json``, or it lacks a size the plan needs.
    """
    if not (cfg.ref.num_gpus or cfg.inference.num_gpus or cfg.training.num_gpus):
        return None
    # Read here rather than with grpo.models.load_hf_config, whose module imports torch.
    config_path = model_config_file(cfg.base_model_path)
    if config_path is None:
        raise ValueError(f"no config.json for {cfg.base_model_path}")
    hf_config = json.loads(config_path.read_text())
    teacher_hf_config = None
    if cfg.ref.teacher_model_path is not None:
        teacher_path = model_config_file(cfg.ref.teacher_model_path)
        if teacher_path is None:
            raise ValueError(f"no config.json for {cfg.ref.teacher_model_path}")
        teacher_hf_config = json.loads(teacher_path.read_text())
    source = "--gpu-memory"
    if gpu_memory is None:
        local = local_gpu_memory()
        gpu_memory, source = local if local is not None else (None, "no GPU here")
    return memory_plan(cfg, hf_config, gpu_memory, source, teacher_hf_config)
