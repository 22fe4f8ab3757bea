"""YAML configs: load, override from the command line, validate, and instantiate components.

A config is a YAML file laid out like torchtune's async GRPO config. The schema below (`SCHEMA`)
is the single description of every key: `validate_config` checks against it,
`load_config` fills its defaults, and `config_reference_markdown` renders it for the README.

Conventions (torchtune's):

* ``grpo run async_grpo --config NAME key=value ...``: NAME is a file in the repo's
  ``configs/`` folder (``configs/NAME.yaml``) or a path to a YAML file.
* ``key.sub=value`` overrides a nested key; values are parsed as YAML (``3``, ``1e-5``,
  ``true``, ``null``, ``[1, 2]``). Overriding a component node with a string replaces its
  ``_component_`` (``dataset=grpo.data.gsm8k_dataset``).
* ``~key`` removes a key. Keys the schema knows fall back to their default (so
  ``~eval_dataset`` turns evaluation off); keys inside a component node fall back to the
  component's own default.
* A node with a ``_component_`` key (a dotted import path) is built by `instantiate`, its other
  keys being keyword arguments.
* ``${key}`` interpolation works as in OmegaConf (``model_dir: ${base_model_path}``).

Relative paths in ``base_model_path``, ``output_dir`` and ``resume_from_checkpoint`` are made
absolute when the config is loaded, because Ray actors may run in another working directory.
They resolve against the current directory; ``base_model_path`` falls back to the repo root
when it does not exist there, so the shipped demo model is found from any directory.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from omegaconf import DictConfig, ListConfig, OmegaConf

import grpo

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """One or more problems with a config; `problems` lists each as ``key: what is wrong``.

    Args:
        problems (str | Sequence[str]): One problem or a list of them.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            message = f"config has {len(self.problems)} problems:\n{lines}"
        super().__init__(message)


class InstantiationError(ConfigError):
    """A ``_component_`` node could not be built: bad import path or bad keyword arguments."""


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Sentinel("required")
# Default of a documented component keyword: whatever the component's own signature says.
COMPONENT_DEFAULT = _Sentinel("component default")
# Marks a value whose interpolation failed; the failure is already reported.
_UNRESOLVED = _Sentinel("unresolved")
# Schema lookups below a component or a free-form mapping: any key may exist there.
_OPEN = _Sentinel("open")

NUMBER = (int, float)
NONE = type(None)


@dataclass(frozen=True)
class Field:
    """A plain value.

    Args:
        types (tuple[type, ...]): Accepted Python types (``NoneType`` for null). ``float``
            accepts ints; ``bool`` is never taken for a number.
        doc (str): One-line description.
        default (Any): Default filled in when the key is absent; `REQUIRED` if none.
        check (Callable[[Any], str | None] | None): Returns what is wrong with a non-null value
            of the right type, or None.
    """

    types: tuple[type, ...]
    doc: str
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Component:
    """A ``_component_`` node built with `instantiate`.

    Args:
        doc (str): One-line description.
        default (Any): Node used when the key is absent: a dict, None (optional), or `REQUIRED`.
        kwargs (Mapping[str, Field]): Documented keyword arguments, checked when present.
            Any other keyword is checked against the component's signature.
    """

    doc: str
    default: Any = REQUIRED
    kwargs: Mapping[str, Field] = field(default_factory=dict)


@dataclass(frozen=True)
class ComponentList:
    """A list of ``_component_`` nodes (e.g. reward functions)."""

    doc: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class Section:
    """A mapping of known keys."""

    doc: str
    fields: Mapping[str, Field | Component | ComponentList | Section]


def _at_least(minimum: float) -> Callable[[Any], str | None]:
    return lambda value: None if value >= minimum else f"must be >= {minimum}, got {value}"


def _greater_than(bound: float) -> Callable[[Any], str | None]:
    return lambda value: None if value > bound else f"must be > {bound}, got {value}"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value in choices:
            return None
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"must be one of {', '.join(choices)}; got {value!r}{hint}"

    return check


def _in_unit_interval(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value}"


def _ray_address(value: str) -> str | None:
    if value == "auto" or value.startswith("ray://") or re.fullmatch(r"[\w.\-]+:\d+", value):
        return None
    return f"must be null (start a local cluster), 'auto', 'ray://HOST:PORT' or 'HOST:PORT'; got {value!r}"


_POSITIVE_INT = _at_least(1)
_NON_NEGATIVE = _at_least(0)
# The workers also take torch's names (float32, bfloat16).
_DTYPE = _one_of("fp32", "bf16", "float32", "bfloat16")

SCHEMA = Section(
    "Top level",
    {
        "base_model_path": Field(
            (str,),
            "Hugging Face model folder (config.json, *.safetensors, vocab.json, merges.txt). "
            "Relative: current directory first, then the repo root.",
        ),
        "output_dir": Field((str,), "Checkpoints, metrics and logs are written here."),
        "seed": Field((int,), "Seed for data order, sampling and initialisation.", 0),
        "target_tokens_per_batch": Field(
            (int,),
            "Token budget of one packed micro-batch (prompt + response tokens). The longest "
            "possible sequence must fit.",
            4096,
            _POSITIVE_INT,
        ),
        "resume_from_checkpoint": Field(
            (bool, str),
            "false: start fresh; true: resume from the latest checkpoint in output_dir; "
            "a path: resume from that checkpoint.",
            False,
        ),
        "debug_logging_enabled": Field(
            (bool,), "Log decoded sample prompts/responses every step.", False
        ),
        "debug_num_samples_per_step": Field(
            (int,), "How many samples the debug log shows per step.", 1, _NON_NEGATIVE
        ),
        "eval_every_n_steps": Field(
            (int, NONE),
            "Evaluate on eval_dataset every N training steps; null: never.",
            None,
            _POSITIVE_INT,
        ),
        "eval_num_examples": Field(
            (int, NONE),
            "Held-out examples per evaluation; null: all of eval_dataset.",
            None,
            _POSITIVE_INT,
        ),
        "ray": Section(
            "Ray cluster",
            {
                "address": Field(
                    (str, NONE),
                    "null: start a local cluster; 'auto' or 'ray://HOST:PORT': join one.",
                    None,
                    _ray_address,
                ),
                "num_cpus": Field(
                    NUMBER + (NONE,),
                    "CPU slots of a local cluster (logical, may exceed the cores); "
                    "null: the machine's core count.",
                    None,
                    _NON_NEGATIVE,
                ),
                "num_gpus": Field(
                    NUMBER + (NONE,),
                    "GPUs of a local cluster; null: all visible GPUs.",
                    None,
                    _NON_NEGATIVE,
                ),
            },
        ),
        "orchestration": Section(
            "Actors and the run length",
            {
                "num_inference_workers": Field(
                    (int,),
                    "vLLM collector actors, each with its own dataset shard.",
                    1,
                    _POSITIVE_INT,
                ),
                "synchronous": Field(
                    (bool,),
                    "true: generate, score and train in lock-step (on-policy, reproducible "
                    "to the bit; for debugging and exact-resume checks); false: overlap them.",
                    False,
                ),
                "num_ref_workers": Field(
                    (int,),
                    "Reference-model actors (ref logprobs, rewards, advantages).",
                    1,
                    _POSITIVE_INT,
                ),
                "num_training_workers": Field(
                    (int,),
                    "Training actors; more than one shards the model with FSDP2.",
                    1,
                    _POSITIVE_INT,
                ),
                "num_steps": Field(
                    (int,), "Optimizer steps to train for.", REQUIRED, _POSITIVE_INT
                ),
                "replay_buffer_size": Field(
                    (int,),
                    "Most trajectories the replay buffer holds; when it is full, scored groups "
                    "wait for room (nothing is dropped).",
                    512,
                    _POSITIVE_INT,
                ),
                "max_policy_lag": Field(
                    (int,),
                    "Drop trajectories generated more than this many weight versions ago "
                    "(0: strictly on-policy).",
                    1,
                    _NON_NEGATIVE,
                ),
                "stall_timeout_s": Field(
                    NUMBER,
                    "Abort the run when no actor finishes any work for this many seconds.",
                    600.0,
                    _greater_than(0),
                ),
                "max_actor_restarts": Field(
                    (int,),
                    "Times each collector, reference actor and the replay buffer may be "
                    "restarted after dying (their work is rebuilt, nothing is lost); one more "
                    "death stops the run with a checkpoint. Trainers are never restarted.",
                    3,
                    _NON_NEGATIVE,
                ),
            },
        ),
        "inference": Section(
            "Generation (vLLM collectors)",
            {
                "batch_size": Field(
                    (int,),
                    "Prompts per generation batch (each sampled group_size times).",
                    8,
                    _POSITIVE_INT,
                ),
                "group_size": Field(
                    (int,),
                    "Responses per prompt; advantages are normalised within a group, so at "
                    "least 2.",
                    8,
                    _at_least(2),
                ),
                "max_prompt_tokens": Field(
                    (int, NONE),
                    "Longest prompt in tokens (longer ones are skipped); null: "
                    "tokenizer.max_seq_len.",
                    None,
                    _POSITIVE_INT,
                ),
                "max_generated_tokens": Field(
                    (int,), "Most tokens generated per response.", 256, _POSITIVE_INT
                ),
                "temperature": Field(NUMBER, "Sampling temperature.", 1.0, _greater_than(0)),
                "top_p": Field(NUMBER, "Nucleus sampling mass.", 1.0, _in_unit_interval),
                "steps_before_weight_sync": Field(
                    (int,),
                    "Generation batches between checks for new weights.",
                    1,
                    _POSITIVE_INT,
                ),
                "queue_maxsize": Field(
                    (int,), "Capacity of the rollout queue, in groups.", 64, _POSITIVE_INT
                ),
                "queue_put_timeout_s": Field(
                    NUMBER,
                    "Timeout in seconds of one put onto a full rollout queue.",
                    1.0,
                    _greater_than(0),
                ),
                "engine_args": Field(
                    (dict,),
                    "Keyword arguments passed through to vllm.LLM (enforce_eager, dtype, "
                    "max_model_len, gpu_memory_utilization, ...).",
                    {},
                ),
                "num_gpus": Field(NUMBER, "GPUs per collector actor.", 0, _NON_NEGATIVE),
                "num_cpus": Field(NUMBER, "CPUs per collector actor.", 1, _NON_NEGATIVE),
            },
        ),
        "ref": Section(
            "Reference model and rewards",
            {
                "num_gpus": Field(NUMBER, "GPUs per reference actor.", 0, _NON_NEGATIVE),
                "num_cpus": Field(NUMBER, "CPUs per reference actor.", 1, _NON_NEGATIVE),
                "reward_timeout_s": Field(
                    NUMBER,
                    "Seconds one reward call may take before it scores 0 (math parsers can hang).",
                    10.0,
                    _greater_than(0),
                ),
                "reward_weights": Field(
                    (list, NONE),
                    "Weight of each reward function in the total reward, in the order of "
                    "reward_functions; null: all 1.",
                    None,
                ),
                "dtype": Field((str,), "Reference model dtype: fp32 or bf16.", "fp32", _DTYPE),
                "mask_kind": Field(
                    (str,),
                    "Attention of reference packs: dense, varlen (fastest on CPU) or flex "
                    "(FlexAttention BlockMask; best on CUDA).",
                    "dense",
                    _one_of("dense", "varlen", "flex"),
                ),
            },
        ),
        "training": Section(
            "Policy optimisation",
            {
                "batch_size": Field(
                    (int,),
                    "Trajectories per optimizer step, split evenly over the training workers.",
                    64,
                    _POSITIVE_INT,
                ),
                "ppo_epochs": Field((int,), "Passes over each sampled batch.", 1, _POSITIVE_INT),
                "optimizer": Component(
                    "Optimizer; the trainer passes the parameters positionally.",
                    {"_component_": "torch.optim.AdamW", "lr": 1e-6},
                    {"lr": Field(NUMBER, "Learning rate.", COMPONENT_DEFAULT, _greater_than(0))},
                ),
                "lr_scheduler": Component(
                    "Learning-rate schedule; the trainer passes the optimizer and "
                    "num_training_steps (num_steps x ppo_epochs). null: constant.",
                    None,
                    {
                        "num_warmup_steps": Field(
                            (int,), "Linear warm-up steps.", COMPONENT_DEFAULT, _NON_NEGATIVE
                        ),
                        "num_cycles": Field(
                            NUMBER,
                            "Cosine cycles (0.5: decay to zero once).",
                            COMPONENT_DEFAULT,
                            _greater_than(0),
                        ),
                    },
                ),
                "loss": Component(
                    "GRPO loss on packed batches.",
                    {"_component_": "grpo.loss.GRPOWithChunkedOutputLoss"},
                    {
                        "epsilon_low": Field(
                            NUMBER,
                            "Lower clip: ratio >= 1 - epsilon_low.",
                            COMPONENT_DEFAULT,
                            _NON_NEGATIVE,
                        ),
                        "epsilon_high": Field(
                            NUMBER,
                            "Upper clip: ratio <= 1 + epsilon_high.",
                            COMPONENT_DEFAULT,
                            _NON_NEGATIVE,
                        ),
                        "kl_coeff": Field(
                            NUMBER,
                            "Weight of the KL penalty to the reference model.",
                            COMPONENT_DEFAULT,
                            _NON_NEGATIVE,
                        ),
                        "kl_estimator": Field(
                            (str,),
                            "KL estimator: k1, k2 or k3.",
                            COMPONENT_DEFAULT,
                            _one_of("k1", "k2", "k3"),
                        ),
                        "aggregation": Field(
                            (str,),
                            "token_mean, seq_mean_token_mean, or seq_mean_token_sum_norm "
                            "(Dr. GRPO).",
                            COMPONENT_DEFAULT,
                            _one_of("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
                        ),
                    },
                ),
                "clip_grad_norm": Field(
                    NUMBER + (NONE,),
                    "Clip the gradient norm to this; null: no clipping.",
                    1.0,
                    _greater_than(0),
                ),
                "steps_before_weight_sync": Field(
                    (int,),
                    "Optimizer steps between pushes of new weights to collectors.",
                    1,
                    _POSITIVE_INT,
                ),
                "max_nonfinite_steps_in_a_row": Field(
                    (int,),
                    "A step whose loss or gradient norm is not finite is skipped (weights and "
                    "optimizer untouched) and counted; this many in a row stop the run with a "
                    "checkpoint.",
                    3,
                    _POSITIVE_INT,
                ),
                "save_every_n_steps": Field(
                    (int, NONE),
                    "Checkpoint every N steps; null: only at the end.",
                    None,
                    _POSITIVE_INT,
                ),
                "num_gpus": Field(NUMBER, "GPUs per training actor.", 0, _NON_NEGATIVE),
                "num_cpus": Field(NUMBER, "CPUs per training actor.", 1, _NON_NEGATIVE),
                "dtype": Field((str,), "Parameter dtype: fp32 or bf16.", "fp32", _DTYPE),
                "mask_kind": Field(
                    (str,),
                    "Attention of packed micro-batches: dense (an [L, L] bool mask), varlen "
                    "(one causal SDPA per sequence; fastest on CPU) or flex (FlexAttention "
                    "BlockMask, O(L) memory; CUDA only for training).",
                    "dense",
                    _one_of("dense", "varlen", "flex"),
                ),
                "compile": Field((bool,), "torch.compile the model and loss.", False),
            },
        ),
        "reward_functions": ComponentList(
            "Reward functions; each scores every response, the rewards are summed."
        ),
        "dataset": Component("Training prompts and answers."),
        "eval_dataset": Component("Evaluation prompts; null: no evaluation.", None),
        "tokenizer": Component(
            "Tokenizer.",
            {"_component_": "grpo.models.load_tokenizer", "model_dir": "${base_model_path}"},
            {
                "max_seq_len": Field(
                    (int, NONE),
                    "Longest encoded sequence; null: no limit.",
                    COMPONENT_DEFAULT,
                    _POSITIVE_INT,
                )
            },
        ),
        "model": Component(
            "Policy and reference model (torchtune module, HF weights).",
            {"_component_": "grpo.models.build_model", "model_dir": "${base_model_path}"},
        ),
        "metric_logger": Component(
            "Metric logger (W&B, JSONL, stdout).",
            REQUIRED,
            {
                "mode": Field(
                    (str,),
                    "W&B mode: online, offline or disabled.",
                    COMPONENT_DEFAULT,
                    _one_of("online", "offline", "disabled"),
                ),
                "project": Field((str,), "W&B project.", COMPONENT_DEFAULT),
                "log_dir": Field((str,), "Folder for local logs.", COMPONENT_DEFAULT),
            },
        ),
    },
)

# Files a model folder must hold; weights are checked separately (*.safetensors).
MODEL_FILES = ("config.json", "vocab.json", "merges.txt")

# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def repo_root() -> Path:
    """The folder holding ``grpo/``, ``configs/`` and ``recipes/``."""
    return Path(grpo.__file__).resolve().parent.parent


def configs_dir() -> Path:
    """Folder of named configs: ``$GRPO_CONFIGS_DIR`` if set, else ``<repo>/configs``."""
    return Path(os.environ.get("GRPO_CONFIGS_DIR") or repo_root() / "configs")


def list_configs() -> list[str]:
    """Names of the configs in `configs_dir`, sorted."""
    folder = configs_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def find_config(name_or_path: str | Path) -> Path:
    """Turn a config name (``configs/NAME.yaml``) or a path into the path of an existing file.

    Args:
        name_or_path (str | Path): A name such as ``tiny_arithmetic_cpu`` or a YAML path.

    Returns:
        Path: The config file.

    Raises:
        ConfigError: If no such file exists; the message lists the available names.
    """
    text = str(name_or_path)
    available = list_configs()
    listing = ", ".join(available) or f"none in {configs_dir()}"
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text
    if looks_like_path or Path(text).is_file():
        path = Path(text).expanduser()
        if path.is_file():
            return path
        raise ConfigError(f"config file {text} not found. Named configs: {listing}")
    path = configs_dir() / f"{text}.yaml"
    if path.is_file():
        return path
    close = difflib.get_close_matches(text, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config {text!r}.{hint} Named configs: {listing}")


def resolve_path(path: str | Path, *, fall_back_to_repo: bool = False) -> Path:
    """Make a config path absolute.

    Args:
        path (str | Path): Absolute, or relative to the current directory.
        fall_back_to_repo (bool): If the relative path does not exist in the current directory
            but does under the repo root, use that one.

    Returns:
        Path: An absolute path (which may not exist).
    """
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    from_cwd = Path.cwd() / path
    if fall_back_to_repo and not from_cwd.exists() and (repo_root() / path).exists():
        return repo_root() / path
    return from_cwd


# --------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------


def load_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load a config, fill schema defaults, apply command-line overrides.

    Args:
        name_or_path (str | Path): Config name (``configs/NAME.yaml``) or path to a YAML file.
        overrides (Sequence[str]): ``key.sub=value`` (value parsed as YAML) or ``~key``.

    Returns:
        DictConfig: The config, not yet validated (see `validate_config`).

    Raises:
        ConfigError: If the file is missing or not a YAML mapping, or overrides are malformed
            or name keys the schema does not know (all override problems are listed at once).

    Example:
        >>> cfg = load_config("tiny_arithmetic_cpu", ["inference.group_size=4", "~eval_dataset"])
        >>> cfg.inference.group_size
        4
    """
    path = find_config(name_or_path)
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError(f"{path}: not a valid YAML config: {exc}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(cfg).__name__}")
    _fill_defaults(cfg, SCHEMA)
    problems: list[str] = []
    for override in overrides:
        try:
            _apply_override(cfg, override)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    # Again: `~key` on a key the schema knows restores its default.
    _fill_defaults(cfg, SCHEMA)
    _absolutize_paths(cfg)
    return cfg


def _fill_defaults(node: DictConfig, section: Section) -> None:
    """Set absent keys to their schema default; component nodes are never merged into."""
    for key, spec in section.fields.items():
        if isinstance(spec, Section):
            child = node._get_node(key) if key in node else None
            if child is None or child._is_none():  # absent, or an empty `inference:` line
                node[key] = {}
                child = node._get_node(key)
            if isinstance(child, DictConfig):
                _fill_defaults(child, spec)
        elif key not in node and spec.default is not REQUIRED:
            node[key] = spec.default


def _absolutize_paths(cfg: DictConfig) -> None:
    for key, fall_back in (("base_model_path", True), ("output_dir", False)):
        value = _try_get(cfg, key)
        if isinstance(value, str) and value:
            cfg[key] = str(resolve_path(value, fall_back_to_repo=fall_back))
    resume = _try_get(cfg, "resume_from_checkpoint")
    if isinstance(resume, str) and resume:
        cfg.resume_from_checkpoint = str(resolve_path(resume))


def _try_get(cfg: DictConfig, key: str) -> Any:
    try:
        return cfg.get(key)
    except Exception:  # a broken interpolation; validate_config reports it
        return None


def _parse_value(raw: str) -> Any:
    """Parse an override value the way OmegaConf parses YAML values ("None" also means null)."""
    if raw == "None":
        return None
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]), resolve=False)["value"]


def _split_key(key: str) -> list[str]:
    # Accept `reward_functions[0].weight` as well as `reward_functions.0.weight`.
    return [part for part in re.split(r"\.|\[(\d+)\]", key) if part]


def _schema_at(parts: Sequence[str]) -> Any:
    """Schema entry of a dotted key: a spec, `_OPEN` (inside a free-form node), or None."""
    spec: Any = SCHEMA
    for part in parts:
        if isinstance(spec, Section):
            spec = spec.fields.get(part)
            if spec is None:
                return None
        elif isinstance(spec, (Component, ComponentList)) or (
            isinstance(spec, Field) and dict in spec.types
        ):
            return _OPEN
        else:  # below a scalar, or unknown
            return _OPEN if spec is _OPEN else None
    return spec


def _all_schema_keys(section: Section = SCHEMA, prefix: str = "") -> list[str]:
    keys = []
    for key, spec in section.fields.items():
        keys.append(prefix + key)
        if isinstance(spec, Section):
            keys.extend(_all_schema_keys(spec, f"{prefix}{key}."))
    return keys


def _suggest(prefix: str, key: str, siblings: Sequence[str]) -> str:
    """A ``; did you mean ...?`` hint for an unknown key, or an empty string."""
    close = difflib.get_close_matches(key, list(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    elsewhere = [full for full in _all_schema_keys() if full.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; did you mean {' or '.join(elsewhere)}?"
    return ""


def _schema_siblings(parts: Sequence[str]) -> list[str]:
    spec = _schema_at(parts) if parts else SCHEMA
    return list(spec.fields) if isinstance(spec, Section) else []


def _walk(cfg: DictConfig, parts: Sequence[str], create: bool, override: str) -> Any:
    """Return the container node at `parts`, creating mappings the schema allows if `create`."""
    node: Any = cfg
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{override}: {dotted} is not an index of a {len(node)}-list")
            node = node._get_node(int(part))
            continue
        child = node._get_node(part) if part in node else None
        if child is None or child._is_none():
            known = _schema_at(parts[: depth + 1])
            may_create = (
                known is _OPEN
                or isinstance(known, (Section, Component))
                or (isinstance(known, Field) and dict in known.types)
            )
            if not (create and may_create):
                raise ConfigError(
                    f"{override}: no key {dotted} in the config"
                    f"{_unknown_hint(node, parts[: depth + 1])}"
                )
            node[part] = {}
            child = node._get_node(part)
        if not isinstance(child, (DictConfig, ListConfig)):
            raise ConfigError(f"{override}: {dotted} is a value, not a mapping")
        node = child
    return node


def _unknown_hint(parent: Any, parts: Sequence[str]) -> str:
    """Did-you-mean for the last of `parts`, among schema keys and keys present in `parent`."""
    siblings = _schema_siblings(parts[:-1])
    if isinstance(parent, DictConfig):
        siblings += [str(key) for key in parent.keys()]
    prefix = ".".join(parts[:-1]) + "." if len(parts) > 1 else ""
    return _suggest(prefix, parts[-1], siblings)


def _apply_override(cfg: DictConfig, override: str) -> None:
    removing = override.startswith("~")
    key, sep, raw = (override[1:] if removing else override).partition("=")
    parts = _split_key(key)
    if removing and (sep or not parts):
        raise ConfigError(f"{override!r}: expected ~key, e.g. ~eval_dataset")
    if not removing and (not sep or not parts):
        raise ConfigError(f"{override!r}: overrides are key=value or ~key")

    parent = _walk(cfg, parts[:-1], create=not removing, override=override)
    last = parts[-1]
    if isinstance(parent, ListConfig):
        if not last.isdigit() or int(last) >= len(parent):
            raise ConfigError(f"{override}: {key} is not an index of a {len(parent)}-list")
        if removing:
            del parent[int(last)]
        else:
            parent[int(last)] = _parse_value(raw)
        return

    if removing:
        if last not in parent:
            raise ConfigError(
                f"{override}: cannot remove {key}, it is not in the config"
                f"{_unknown_hint(parent, parts)}"
            )
        del parent[last]
        return

    value = _parse_value(raw)
    current = parent._get_node(last) if last in parent else None
    if current is None and _schema_at(parts) is None:
        raise ConfigError(f"{override}: unknown key {key}{_unknown_hint(parent, parts)}")
    if (
        isinstance(current, DictConfig)
        and not current._is_none()
        and "_component_" in current
        and isinstance(value, str)
    ):
        # torchtune's shorthand: `dataset=pkg.fn` swaps the component, keeping its kwargs.
        current["_component_"] = value
    else:
        parent[last] = value


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def validate_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    check_files: bool = True,
    check_components: bool = True,
) -> None:
    """Check a config against the schema and report every problem at once.

    Checks unknown keys (with did-you-mean), types, value ranges and enums, relations between
    keys (token budget, divisibility, buffer size, Ray resources), the model folder, and that
    every ``_component_`` imports and accepts its keyword arguments. Nothing is instantiated.

    Args:
        cfg (DictConfig | Mapping[str, Any]): The config, e.g. from `load_config`.
        check_files (bool): Check the model folder and the resume checkpoint exist.
        check_components (bool): Import every ``_component_`` and check its keyword arguments.

    Raises:
        ConfigError: Listing every problem, each as ``key: what is wrong``.

    Example:
        >>> validate_config(load_config("tiny_arithmetic_cpu"))
    """
    problems: list[str] = []
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a config must be a mapping, got {type(cfg).__name__}")
    # A copy with the schema defaults, as `load_config` would give it; the caller's is untouched.
    cfg = OmegaConf.create(dict(cfg))
    _fill_defaults(cfg, SCHEMA)
    values = _resolve_all(cfg, "", problems)
    _check_section(SCHEMA, values, "", problems, check_components)
    _check_relations(values, problems)
    if check_files:
        _check_files(values, problems)
    if problems:
        raise ConfigError(problems)


def _resolve_all(node: Any, path: str, problems: list[str]) -> Any:
    """Plain Python copy of `node` with interpolations resolved; failures become _UNRESOLVED."""
    if isinstance(node, DictConfig):
        if node._is_none():
            return None
        out = {}
        for key in node.keys():
            full = f"{path}.{key}" if path else str(key)
            try:
                child = node[key]
            except Exception as exc:  # interpolation or missing-value errors of OmegaConf
                problems.append(f"{full}: {str(exc).splitlines()[0]}")
                out[key] = _UNRESOLVED
                continue
            out[key] = _resolve_all(child, full, problems)
        return out
    if isinstance(node, ListConfig):
        if node._is_none():
            return None
        out_list = []
        for index in range(len(node)):
            full = f"{path}[{index}]"
            try:
                child = node[index]
            except Exception as exc:
                problems.append(f"{full}: {str(exc).splitlines()[0]}")
                out_list.append(_UNRESOLVED)
                continue
            out_list.append(_resolve_all(child, full, problems))
        return out_list
    return node


def _type_name(types: tuple[type, ...]) -> str:
    names = {
        int: "int",
        float: "float",
        bool: "bool",
        str: "string",
        dict: "mapping",
        list: "list",
        NONE: "null",
    }
    if int in types and float in types:
        types = tuple(t for t in types if t is not int)
        names = {**names, float: "number"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _check_field(path: str, spec: Field, value: Any, problems: list[str]) -> None:
    if value is _UNRESOLVED:
        return
    if not _type_ok(value, spec.types):
        problems.append(f"{path}: expected {_type_name(spec.types)}, got {value!r}")
        return
    if value is not None and spec.check is not None:
        message = spec.check(value)
        if message:
            problems.append(f"{path}: {message}")


def _check_section(
    section: Section, values: dict, prefix: str, problems: list[str], check_components: bool
) -> None:
    for key in values:
        if key not in section.fields:
            hint = _suggest(prefix, str(key), list(section.fields))
            problems.append(f"{prefix}{key}: unknown key{hint}")
    for key, spec in section.fields.items():
        path = prefix + key
        if key not in values:
            if not isinstance(spec, Section) and spec.default is REQUIRED:
                problems.append(f"{path}: required key is missing")
            elif isinstance(spec, Section):
                _check_section(spec, {}, f"{path}.", problems, check_components)
            continue
        value = values[key]
        if value is _UNRESOLVED:
            continue
        if isinstance(spec, Section):
            if not isinstance(value, dict):
                problems.append(f"{path}: expected a mapping, got {value!r}")
            else:
                _check_section(spec, value, f"{path}.", problems, check_components)
        elif isinstance(spec, Field):
            if value is None and spec.default is REQUIRED:
                problems.append(f"{path}: required, got null")
            else:
                _check_field(path, spec, value, problems)
        elif isinstance(spec, Component):
            if value is None:
                if spec.default is REQUIRED:
                    problems.append(f"{path}: required component is null")
            else:
                _check_component(path, value, spec.kwargs, problems, check_components)
        elif isinstance(spec, ComponentList):
            if not isinstance(value, list) or not value:
                problems.append(f"{path}: expected a non-empty list of _component_ nodes")
            else:
                for index, item in enumerate(value):
                    _check_component(f"{path}[{index}]", item, {}, problems, check_components)


def _check_component(
    path: str,
    node: Any,
    kwarg_specs: Mapping[str, Field],
    problems: list[str],
    check_components: bool,
) -> None:
    if node is _UNRESOLVED:
        return
    if not isinstance(node, dict) or "_component_" not in node:
        problems.append(
            f"{path}: expected a mapping with a _component_ key (a dotted import path), "
            f"got {node!r}"
        )
        return
    target = node["_component_"]
    if not isinstance(target, str) or not target:
        problems.append(f"{path}._component_: expected a dotted import path, got {target!r}")
        return
    for key, spec in kwarg_specs.items():
        if key in node:
            _check_field(f"{path}.{key}", spec, node[key], problems)
    if check_components:
        try:
            component = locate(target)
        except InstantiationError as exc:
            problems.append(f"{path}._component_: {exc}")
        else:
            accepted = _keyword_names(component)
            if accepted is not None:
                for key in node:
                    if key != "_component_" and key not in accepted:
                        close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
                        hint = f"; did you mean {close[0]}?" if close else ""
                        problems.append(f"{path}.{key}: {target} takes no argument {key!r}{hint}")
    # Nested components (e.g. a dataset's prompt template) are built by `instantiate` too.
    for key, value in node.items():
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, dict) and "_component_" in item:
                suffix = f"[{index}]" if isinstance(value, list) else ""
                _check_component(f"{path}.{key}{suffix}", item, {}, problems, check_components)


def _keyword_names(component: Any) -> set[str] | None:
    """Keyword names `component` accepts, or None if it takes **kwargs or has no signature."""
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):
        return None
    names = set()
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            names.add(parameter.name)
    return names


def _get(values: dict, path: str, types: tuple[type, ...] = NUMBER) -> Any:
    """Value at a dotted path if present, resolved and of `types` (bool never a number)."""
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is _UNRESOLVED or node is None or not _type_ok(node, types):
        return None
    return node


def _max_prompt(values: dict) -> tuple[int, str] | None:
    """Longest possible prompt and the key that bounds it, or None if neither key is set."""
    bounds = [
        (limit, key)
        for key in ("inference.max_prompt_tokens", "tokenizer.max_seq_len")
        if (limit := _get(values, key, (int,))) is not None
    ]
    # The tokenizer truncates to max_seq_len, so the smaller bound is the real one.
    return min(bounds) if bounds else None


def _check_relations(values: dict, problems: list[str]) -> None:
    """Checks that involve more than one key; each skips when a key it needs is invalid."""
    inference = values.get("inference") if isinstance(values.get("inference"), dict) else {}
    tokenizer = values.get("tokenizer") if isinstance(values.get("tokenizer"), dict) else {}
    max_prompt = _max_prompt(values)
    if (
        max_prompt is None
        and inference.get("max_prompt_tokens") is None
        and tokenizer.get("max_seq_len") is None
    ):
        problems.append(
            "inference.max_prompt_tokens: null while tokenizer.max_seq_len is not set; one of "
            "them must bound the prompt length so that packs can be sized"
        )
    max_generated = _get(values, "inference.max_generated_tokens", (int,))
    if max_prompt is not None and max_generated is not None:
        (prompt_tokens, prompt_key), longest = max_prompt, max_prompt[0] + max_generated
        bound = (
            f"{prompt_key} ({prompt_tokens}) + inference.max_generated_tokens "
            f"({max_generated}) = {longest}"
        )
        budget = _get(values, "target_tokens_per_batch", (int,))
        if budget is not None and budget < longest:
            problems.append(
                f"target_tokens_per_batch: {budget} cannot hold the longest sequence, {bound}"
            )
        max_model_len = _get(values, "inference.engine_args.max_model_len", (int,))
        if max_model_len is not None and max_model_len < longest:
            problems.append(
                f"inference.engine_args.max_model_len: {max_model_len} is shorter than {bound}"
            )

    train_batch = _get(values, "training.batch_size", (int,))
    num_trainers = _get(values, "orchestration.num_training_workers", (int,))
    if train_batch is not None and num_trainers and train_batch % num_trainers:
        problems.append(
            f"training.batch_size: {train_batch} is not divisible by "
            f"orchestration.num_training_workers ({num_trainers}); each worker trains on an "
            "equal share"
        )
    # training.batch_size need not be a multiple of inference.group_size: advantages are
    # computed per whole group before trajectories enter the buffer, so a step may mix groups.
    buffer_size = _get(values, "orchestration.replay_buffer_size", (int,))
    if buffer_size is not None and train_batch is not None and buffer_size < train_batch:
        problems.append(
            f"orchestration.replay_buffer_size: {buffer_size} is smaller than "
            f"training.batch_size ({train_batch}); a batch could never be sampled"
        )

    if (
        _get(values, "eval_every_n_steps", (int,)) is not None
        and values.get("eval_dataset") is None
    ):
        problems.append("eval_every_n_steps: set, but eval_dataset is null")

    weights = _get(values, "ref.reward_weights", (list,))
    functions = values.get("reward_functions")
    if weights is not None:
        if not all(_type_ok(weight, NUMBER) for weight in weights):
            problems.append(f"ref.reward_weights: expected a list of numbers, got {weights!r}")
        elif isinstance(functions, list) and len(weights) != len(functions):
            problems.append(
                f"ref.reward_weights: {len(weights)} weights for {len(functions)} "
                "reward_functions; give one weight per function"
            )

    engine_args = _get(values, "inference.engine_args", (dict,))
    if engine_args and "model" in engine_args:
        problems.append("inference.engine_args.model: the model comes from base_model_path")

    _check_ray_resources(values, problems)


def _check_ray_resources(values: dict, problems: list[str]) -> None:
    """A local cluster must have room for every actor, or Ray waits forever to place one."""
    ray_section = values.get("ray")
    if not isinstance(ray_section, dict) or ray_section.get("address") is not None:
        return  # an existing cluster: its size is not known here
    roles = (
        ("inference", "num_inference_workers"),
        ("ref", "num_ref_workers"),
        ("training", "num_training_workers"),
    )
    for resource in ("num_cpus", "num_gpus"):
        needed, terms = 0.0, []
        for section, count_key in roles:
            per_actor = _get(values, f"{section}.{resource}")
            count = _get(values, f"orchestration.{count_key}", (int,))
            if per_actor is None or count is None:
                break
            needed += per_actor * count
            terms.append(f"{count} x {section}.{resource} ({per_actor})")
        else:
            if needed == 0:
                continue
            have = _get(values, f"ray.{resource}")
            if have is None:
                have = (os.cpu_count() or 1) if resource == "num_cpus" else _visible_gpus()
            if needed > have + 1e-9:
                problems.append(
                    f"ray.{resource}: the actors need {needed:g} ({' + '.join(terms)}) but the "
                    f"local Ray cluster has {have:g}; raise ray.{resource} or lower the "
                    "per-actor amounts"
                )


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _check_files(values: dict, problems: list[str]) -> None:
    model_path = values.get("base_model_path")
    if isinstance(model_path, str) and model_path:
        folder = resolve_path(model_path, fall_back_to_repo=True)
        if not folder.is_dir():
            problems.append(f"base_model_path: model folder {folder} does not exist")
        else:
            missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
            if not any(folder.glob("*.safetensors")):
                missing.append("*.safetensors")
            if missing:
                problems.append(
                    f"base_model_path: {folder} lacks {', '.join(missing)} (expected a "
                    "Hugging Face model folder)"
                )
            _check_model_config(folder, values, problems)
    resume = values.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume and not resolve_path(resume).exists():
        problems.append(f"resume_from_checkpoint: {resolve_path(resume)} does not exist")


def _check_model_config(folder: Path, values: dict, problems: list[str]) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        return
    try:
        model_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"base_model_path: {config_path} is not valid JSON: {exc}")
        return
    max_positions = model_config.get("max_position_embeddings")
    max_prompt = _max_prompt(values)
    max_generated = _get(values, "inference.max_generated_tokens", (int,))
    if isinstance(max_positions, int) and max_prompt is not None and max_generated is not None:
        longest = max_prompt[0] + max_generated
        if longest > max_positions:
            problems.append(
                f"inference.max_generated_tokens: {max_prompt[1]} ({max_prompt[0]}) + "
                f"inference.max_generated_tokens ({max_generated}) = {longest} exceeds the "
                f"model's max_position_embeddings ({max_positions}) in {config_path}"
            )


# --------------------------------------------------------------------------------------------
# Instantiation
# --------------------------------------------------------------------------------------------


def locate(path: str) -> Any:
    """Import the object at a dotted path (``torch.optim.AdamW``).

    Args:
        path (str): Module path followed by attribute names.

    Returns:
        Any: The object.

    Raises:
        InstantiationError: Naming the path, what could not be found, and a close name if any.
    """
    parts = path.split(".")
    if not all(parts):
        raise InstantiationError(f"{path!r} is not a dotted import path")
    if parts[0] == "torchtune":
        # torchtune 0.6.1's `torchtune.training` imports names that torchao 0.16 dropped;
        # importing grpo.models first installs its compatibility aliases.
        importlib.import_module("grpo.models")
    obj: Any = None
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[: depth + 1])
        if depth and hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if depth and not isinstance(obj, ModuleType):
            raise InstantiationError(
                f"cannot import {path!r}: {'.'.join(parts[:depth])} has no attribute "
                f"{part!r}{_close_attr(obj, part)}"
            )
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as exc:
            if exc.name != prefix:  # the module exists but one of its imports failed
                raise InstantiationError(
                    f"cannot import {path!r}: importing {prefix} failed: {exc}"
                ) from exc
            where = (
                f"module {'.'.join(parts[:depth])} has no {part!r}"
                if depth
                else f"no module named {part!r}"
            )
            hint = _close_attr(obj, part) if depth else ""
            raise InstantiationError(f"cannot import {path!r}: {where}{hint}") from None
        except Exception as exc:
            raise InstantiationError(
                f"cannot import {path!r}: importing {prefix} failed: {type(exc).__name__}: {exc}"
            ) from exc
    return obj


def _close_attr(obj: Any, name: str) -> str:
    candidates = [attr for attr in dir(obj) if not attr.startswith("_")]
    if isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
        import pkgutil

        candidates += [info.name for info in pkgutil.iter_modules(obj.__path__)]
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _node_key(node: Any) -> str:
    """Dotted key of an OmegaConf node within its config (``reward_functions[1]``), or ""."""
    parts: list[str] = []
    try:
        while node._get_parent() is not None:
            parent, key = node._get_parent(), node._key()
            parts.append(f"[{key}]" if isinstance(parent, ListConfig) else f".{key}")
            node = parent
    except AttributeError:  # a plain dict: messages then name the component only
        return ""
    return "".join(reversed(parts)).lstrip(".")


def instantiate(node: DictConfig | Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
    """Build the object a ``_component_`` node describes.

    The other keys of the node are keyword arguments; nested ``_component_`` nodes (in values
    or lists) are built first; `kwargs` override the node's keys. Values reach the component as
    plain Python dicts and lists with interpolations resolved.

    Args:
        node (DictConfig | Mapping[str, Any] | None): The node; None returns None, so optional
            components (``lr_scheduler: null``) need no special case.
        *args (Any): Positional arguments, e.g. the parameters of an optimizer.
        **kwargs (Any): Keyword arguments that take precedence over the node's.

    Returns:
        Any: What the component returned.

    Raises:
        InstantiationError: If the node has no ``_component_``, the path does not import, or
            the keyword arguments do not fit its signature; the message names the config key
            and the component. An exception raised inside the component propagates with a
            note naming both.

    Example:
        >>> optimizer = instantiate(cfg.training.optimizer, model.parameters(), lr=1e-5)
    """
    if node is None:
        return None
    key = _node_key(node)
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            plain = OmegaConf.to_container(node, resolve=True)
        except Exception as exc:
            raise InstantiationError(f"{key or 'config'}: {str(exc).splitlines()[0]}") from None
    else:
        plain = dict(node)
    return _build(plain, key, args, kwargs)


def _build(node: Any, key: str, args: tuple, kwargs: dict) -> Any:
    if not isinstance(node, Mapping) or "_component_" not in node:
        raise InstantiationError(
            f"{_at(key)}cannot instantiate {node!r}: expected a mapping with a _component_ key"
        )
    target = node["_component_"]
    if not isinstance(target, str):
        raise InstantiationError(
            f"{_at(key, '_component_')}expected a dotted import path, got {target!r}"
        )
    try:
        component = locate(target)
    except InstantiationError as exc:
        raise InstantiationError(f"{_at(key, '_component_')}{exc}") from None
    node_kwargs = {
        name: _build_nested(value, f"{key}.{name}" if key else name)
        for name, value in node.items()
        if name != "_component_"
    }
    node_kwargs.update(kwargs)
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):  # some builtins have no signature; let the call decide
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **node_kwargs)
        except TypeError as exc:
            accepted = _keyword_names(component)
            unknown = [
                name for name in node_kwargs if accepted is not None and name not in accepted
            ]
            if unknown:
                details = []
                for name in unknown:
                    close = difflib.get_close_matches(name, sorted(accepted or ()), n=1)
                    details.append(
                        f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    )
                detail = f"unexpected argument {', '.join(details)}"
            else:
                detail = str(exc)
            raise InstantiationError(f"{_at(key)}cannot call {target}: {detail}") from None
    try:
        return component(*args, **node_kwargs)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"while instantiating {target}" + (f" (config key {key})" if key else ""))
        raise


def _at(key: str, child: str = "") -> str:
    """Message prefix naming the config key (``training.loss: ``), empty if unknown."""
    full = ".".join(part for part in (key, child) if part)
    return f"{full}: " if full else ""


def _build_nested(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and "_component_" in value:
        return _build(value, key, (), {})
    if isinstance(value, list):
        return [_build_nested(item, f"{key}[{index}]") for index, item in enumerate(value)]
    return value


# --------------------------------------------------------------------------------------------
# Running recipes
# --------------------------------------------------------------------------------------------


Recipe = Callable[[DictConfig], Any]


def run_recipe(
    recipe_main: Recipe, config: str | Path, overrides: Sequence[str] = (), prog: str = "grpo run"
) -> int:
    """Load and validate a config, then call ``recipe_main(cfg)``.

    Config problems are printed to stderr without a traceback; errors inside the recipe
    propagate.

    Args:
        recipe_main (Recipe): The recipe's entry point.
        config (str | Path): Config name or path.
        overrides (Sequence[str]): ``key=value`` / ``~key`` overrides.
        prog (str): Program name used in error messages.

    Returns:
        int: 0 on success (or the recipe's int return value), 2 on a config error.
    """
    try:
        cfg = load_config(config, overrides)
        validate_config(cfg)
        result = recipe_main(cfg)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_recipe_cli(recipe_main: Recipe, argv: Sequence[str] | None = None) -> NoReturn:
    """Command line of a recipe file: ``python recipes/x.py --config NAME key=value ...``.

    Loads, validates and runs like ``grpo run``, then exits the process with the status.

    Args:
        recipe_main (Recipe): The recipe's entry point.
        argv (Sequence[str] | None): Arguments; None reads ``sys.argv[1:]``.

    Raises:
        SystemExit: Always, with the status of `run_recipe` (2 on a config error).

    Example:
        >>> if __name__ == "__main__":
        ...     run_recipe_cli(recipe_main)
    """
    parser = argparse.ArgumentParser(
        description=recipe_main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="config name (configs/NAME.yaml) or path")
    parser.add_argument("overrides", nargs="*", help="key=value or ~key overrides")
    args, extra = parser.parse_known_args(argv)
    overrides = split_overrides(parser, args.overrides, extra)
    sys.exit(run_recipe(recipe_main, args.config, overrides, prog=parser.prog))


def split_overrides(
    parser: argparse.ArgumentParser, overrides: Sequence[str], extra: Sequence[str]
) -> list[str]:
    """Overrides after ``--config`` land in argparse's leftovers; accept those, reject flags."""
    flags = [arg for arg in extra if arg.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)} (overrides are key=value)")
    return [*overrides, *extra]


def parse(recipe_main: Recipe) -> Callable[..., Any]:
    """Decorator giving a recipe's main function the config command line, torchtune style.

    Called with no arguments (``recipe_main()`` in ``if __name__ == "__main__":``) it parses
    ``--config NAME key=value ...`` from ``sys.argv`` and exits with the status; called with a
    config (as ``grpo run`` does) it simply runs the recipe.

    Args:
        recipe_main (Recipe): The recipe's entry point, taking the config.

    Returns:
        Callable[..., Any]: The wrapped entry point.

    Example:
        >>> @parse
        ... def recipe_main(cfg: DictConfig) -> None:
        ...     ...
        >>> if __name__ == "__main__":
        ...     recipe_main()
    """

    @functools.wraps(recipe_main)
    def wrapper(cfg: DictConfig | None = None) -> Any:
        if cfg is not None:
            return recipe_main(cfg)
        run_recipe_cli(recipe_main)

    return wrapper


# --------------------------------------------------------------------------------------------
# Reference documentation
# --------------------------------------------------------------------------------------------


def _format_default(value: Any) -> str:
    if value is REQUIRED:
        return "**required**"
    if value is COMPONENT_DEFAULT:
        return "(component's)"
    if isinstance(value, dict) and "_component_" in value:
        rest = {k: v for k, v in value.items() if k != "_component_"}
        extra = ", " + ", ".join(f"{k}: {v}" for k, v in rest.items()) if rest else ""
        return f"`{value['_component_']}`{extra}"
    return f"`{json.dumps(value)}`"


def config_reference_markdown() -> str:
    """Render every config key with its type, default and description as Markdown tables.

    Returns:
        str: One table per section, for the README.
    """
    lines: list[str] = []

    def table(section: Section, prefix: str, title: str) -> None:
        rows: list[str] = []
        nested: list[tuple[Section, str]] = []
        for key, spec in section.fields.items():
            path = prefix + key
            if isinstance(spec, Section):
                nested.append((spec, f"{path}."))
            elif isinstance(spec, Field):
                rows.append(
                    f"| `{path}` | {_type_name(spec.types)} | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
            elif isinstance(spec, Component):
                optional = " or null" if spec.default is None else ""
                rows.append(
                    f"| `{path}` | component{optional} | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
                for name, kwarg in spec.kwargs.items():
                    rows.append(
                        f"| `{path}.{name}` | {_type_name(kwarg.types)} | "
                        f"{_format_default(kwarg.default)} | {kwarg.doc} |"
                    )
            else:
                rows.append(
                    f"| `{path}` | list of components | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
        if rows:
            lines.extend(
                [
                    f"### {title}",
                    "",
                    "| Key | Type | Default | Description |",
                    "|---|---|---|---|",
                    *rows,
                    "",
                ]
            )
        for child, child_prefix in nested:
            table(child, child_prefix, f"`{child_prefix[:-1]}`: {child.doc}")

    table(SCHEMA, "", SCHEMA.doc)
    return "\n".join(lines)
