"""The stand-in components the config tests name, and a small valid config built from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo.config import ConfigError
from grpo.preflight import validate_run_config

# Small stand-ins for the real components, so these tests import nothing heavy.
COMPONENTS_SOURCE = """
class Template:
    def __init__(self, chat=False):
        self.chat = chat


def make_dataset(num_examples=10, seed=0, template=None):
    return {"num_examples": num_examples, "seed": seed, "template": template}


class Reward:
    def __init__(self, weight=1.0, name=None):
        self.weight = weight


class Loss:
    def __init__(self, epsilon_low=0.2, epsilon_high=0.2, kl_coeff=0.0, kl_estimator="k3",
                 aggregation="token_mean"):
        self.epsilon_low = epsilon_low


class Logger:
    def __init__(self, log_dir=None, project="grpo", mode="offline"):
        self.log_dir = log_dir


def explode(value=0):
    raise RuntimeError("boom")
"""


COMPONENTS = "grpo_test_config_components"


def valid_config(model_dir: Path, output_dir: Path) -> dict:
    """A small config that passes validation, built from the stand-in components."""
    return {
        "base_model_path": str(model_dir),
        "output_dir": str(output_dir),
        "target_tokens_per_batch": 256,
        "eval_every_n_steps": 2,
        "ray": {"num_cpus": 8, "num_gpus": 0},
        "orchestration": {"num_steps": 3, "replay_buffer_size": 64},
        "inference": {
            "batch_size": 2,
            "group_size": 4,
            "max_prompt_tokens": 32,
            "max_generated_tokens": 16,
            "engine_args": {"enforce_eager": True, "max_model_len": 128},
        },
        "training": {
            "batch_size": 8,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0},
            "loss": {"_component_": f"{COMPONENTS}.Loss", "kl_estimator": "k2"},
        },
        "reward_functions": [
            {"_component_": f"{COMPONENTS}.Reward"},
            {"_component_": f"{COMPONENTS}.Reward", "weight": 0.5},
        ],
        "dataset": {
            "_component_": f"{COMPONENTS}.make_dataset",
            "seed": "${seed}",
            "template": {"_component_": f"{COMPONENTS}.Template", "chat": True},
        },
        "eval_dataset": {"_component_": f"{COMPONENTS}.make_dataset", "num_examples": 3},
        "metric_logger": {"_component_": f"{COMPONENTS}.Logger", "log_dir": "${output_dir}"},
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def problems_of(cfg, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, **kwargs)
    return info.value.problems
