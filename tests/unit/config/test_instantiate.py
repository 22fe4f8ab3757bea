"""Building components from ``_component_`` nodes (`grpo.config.instantiate`) and the errors that
name the key and the component.
"""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import (
    InstantiationError,
    compose_config,
    instantiate,
)
from tests.unit.config.helpers import COMPONENTS


def test_instantiate_builds_nested_components(config_path):
    cfg = compose_config(config_path)
    dataset = instantiate(cfg.dataset)
    assert dataset["seed"] == cfg.seed  # interpolation resolved
    assert type(dataset["template"]).__name__ == "Template"  # nested node built first
    assert dataset["template"].chat is True
    rewards = [instantiate(node) for node in cfg.reward_functions]
    assert [reward.weight for reward in rewards] == [1.0, 0.5]


def test_instantiate_positional_args_and_kwarg_overrides(config_path):
    cfg = compose_config(config_path)
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = instantiate(cfg.training.optimizer, params, lr=0.5)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 0.5  # the keyword wins over the config
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # from the config
    assert (
        instantiate({"_component_": f"{COMPONENTS}.make_dataset"}, num_examples=4)["num_examples"]
        == 4
    )


def test_instantiate_none_is_none():
    assert instantiate(None) is None


def test_instantiate_bad_path_names_key_and_component(config_path):
    cfg = compose_config(config_path, [f"training.loss._component_={COMPONENTS}.Los"])
    with pytest.raises(InstantiationError) as info:
        instantiate(cfg.training.loss)
    message = str(info.value)
    assert message.startswith("training.loss._component_:")
    assert f"{COMPONENTS}.Los" in message and "did you mean 'Loss'" in message


def test_instantiate_bad_keyword_names_key_and_component(config_path):
    cfg = compose_config(config_path, ["training.loss.kl_coef=0.1"])
    with pytest.raises(InstantiationError) as info:
        instantiate(cfg.training.loss)
    message = str(info.value)
    assert message.startswith("training.loss:")
    assert f"{COMPONENTS}.Loss" in message
    assert "'kl_coef' (did you mean 'kl_coeff'?)" in message


def test_instantiate_error_in_a_list_item_names_its_index(config_path):
    cfg = compose_config(config_path, ["reward_functions.1.wieght=2"])
    with pytest.raises(InstantiationError, match=r"^reward_functions\[1\]: cannot call "):
        instantiate(cfg.reward_functions[1])
    # A plain dict (as actors receive nodes) has no key: the message names the component.
    node = OmegaConf.to_container(cfg.reward_functions[1])
    with pytest.raises(InstantiationError, match=rf"^cannot call {COMPONENTS}\.Reward: "):
        instantiate(node)


def test_instantiate_nested_failure_names_the_nested_key(config_path):
    cfg = compose_config(config_path, ["dataset.template.chatty=1"])
    with pytest.raises(InstantiationError, match=r"^dataset\.template: "):
        instantiate(cfg.dataset)


def test_instantiate_without_component_key():
    with pytest.raises(InstantiationError, match="_component_"):
        instantiate(OmegaConf.create({"lr": 1.0}))


def test_errors_inside_a_component_keep_their_type_and_gain_a_note():
    node = OmegaConf.create({"thing": {"_component_": f"{COMPONENTS}.explode"}})
    with pytest.raises(RuntimeError, match="boom") as info:
        instantiate(node.thing)
    if sys.version_info >= (3, 11):
        assert any("thing" in note and "explode" in note for note in info.value.__notes__)
