"""A Llama-family model's HF config, read without importing transformers' model modules.

Importing any of transformers 5's model configs (``LlamaConfig``, ``Qwen2Config``, ...) imports
``transformers.activations``, whose hub-kernels integration imports ``torch.distributed.tensor``
and with it sympy and mpmath: 51 MiB resident and most of a second for every process that loads
a model, none of it used here. The engine reads a fixed set of fields; this module fills them
with the defaults and post-init rules of the four classes it supports and keeps everything else
in the file as is. File resolution (config.json, a GGUF's metadata) and rope standardisation are
transformers' own. ``tests/engine/models/test_hf_config.py`` checks every field the engine reads
against the real classes.

The config is an instance of a small ``PretrainedConfig`` subclass per model_type: ``to_dict``
and ``save_pretrained`` write the class attribute ``model_type`` (the base class's is ""), so a
saved config reloads with ``AutoConfig`` as the model's own class.
"""

import copy
import os
from typing import Any

from transformers import PretrainedConfig

# The class defaults of each supported model_type, for the fields the engine reads.
_COMMON: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}  # fmt: skip
_QWEN: dict[str, Any] = {
    "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 28, "layer_types": None,
}  # fmt: skip
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "intermediate_size": 11008, "max_position_embeddings": 2048, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "mistral": {
        "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}  # fmt: skip
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim")  # None: derived from the others


class ModelConfig(PretrainedConfig):
    """The fields of one model_type's config file, with the engine's defaults filled in."""


class LlamaModelConfig(ModelConfig):
    model_type = "llama"


class MistralModelConfig(ModelConfig):
    model_type = "mistral"


class Qwen2ModelConfig(ModelConfig):
    model_type = "qwen2"


class Qwen3ModelConfig(ModelConfig):
    model_type = "qwen3"


_CLASSES = {cls.model_type: cls for cls in ModelConfig.__subclasses__()}


def read_model_config(path: str, gguf_file: str | None = None) -> ModelConfig:
    """The config of the HF model directory (or config.json) ``path``, or of the GGUF file
    ``gguf_file`` in folder ``path``; ValueError for a model_type the engine does not run."""
    raw, _ = PretrainedConfig.get_config_dict(path, gguf_file=gguf_file)
    config = model_config_from_dict(raw)
    config._name_or_path = os.path.dirname(path) if os.path.isfile(path) else path
    return config


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """What ``AutoConfig.for_model(**raw)`` gives in every field the engine reads."""
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {list(_DEFAULTS)}"
        )
    fields = {**_COMMON, **_DEFAULTS[model_type], **copy.deepcopy(raw)}
    rope = {key: fields.pop(key) for key in ("rope_theta", "rope_scaling") if key in fields}
    fields.setdefault("rope_parameters", None)
    _check_shapes(fields)
    # The classes' __post_init__ rules.
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if model_type in ("llama", "mistral") and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not fields["use_sliding_window"]:
            fields["sliding_window"] = None
        if fields["layer_types"] is None:
            first = fields["max_window_layers"] if fields["sliding_window"] is not None else None
            fields["layer_types"] = [
                "sliding_attention" if first is not None and i >= first else "full_attention"
                for i in range(fields["num_hidden_layers"])
            ]
    config = _CLASSES[model_type].from_dict(fields)
    config.convert_rope_params_to_dict(**rope)
    return config


def _check_shapes(fields: dict[str, Any]) -> None:
    """ValueError naming the field for a shape the model cannot be built with (transformers
    raises its own errors for some, a ZeroDivisionError or nothing for others)."""
    for name in _POSITIVE_INTS:
        value = fields.get(name)
        if value is None and name in _OPTIONAL_INTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config {name} must be a positive integer, got {value!r}")
    eps = fields["rms_norm_eps"]
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"config rms_norm_eps must be a positive number, got {eps!r}")
    heads = fields["num_attention_heads"]
    kv_heads = fields["num_key_value_heads"] or heads
    if heads % kv_heads:
        raise ValueError(
            f"config num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
            f"({kv_heads})"
        )
