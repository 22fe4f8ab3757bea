"""Let ``torchtune.training`` import with torchao 0.16: import this module first.

torchtune 0.6.1 imports ``int4_weight_only`` and ``int8_dynamic_activation_int4_weight``,
aliases that torchao 0.16 removed; without them every ``torchtune.training`` import fails.
"""

import torchao.quantization

_ALIASES = {
    "int4_weight_only": "Int4WeightOnlyConfig",
    "int8_dynamic_activation_int4_weight": "Int8DynamicActivationInt4WeightConfig",
}
for _old_name, _config_name in _ALIASES.items():
    if not hasattr(torchao.quantization, _old_name):
        setattr(torchao.quantization, _old_name, getattr(torchao.quantization, _config_name))
