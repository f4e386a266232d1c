"""The on-disk format of an EAGLE-style draft head (the contract between the trainer and the
engine's proposer).

A head directory holds ``model.safetensors`` (exactly the tensors of ``expected_shapes``),
``config.json`` (``architecture``, ``hidden_size``, ``draft_vocab_size``, ``target_vocab_size``,
``target_model``, ``layer_config``, and for ``eagle3`` ``feature_layers``) and optionally
``manifest.json`` (how it was trained).

The head, for a target with hidden size H: at position i its input is
``fc([embed(token_i); feature_{i-1}])`` (the target's own frozen embedding, not stored here;
zeros before position 0), then one Llama decoder layer built from ``layer_config``;
``lm_head(h_i)`` of the layer's output gives logits over the draft vocabulary for token i+1,
and a chain draft feeds h_i as the next position's feature. The target's feature_j is

- ``eagle1``: its final hidden state after its final norm (h_i is trained to approximate it);
- ``eagle3``: ``fuse([hidden_{l1}; ...; hidden_{ln}; final])``, EAGLE-3's fused features:
  hidden_l is the hidden state after target layer l (0-based, the residual stream before any
  norm; HF's ``hidden_states[l + 1]``) for l in ``feature_layers`` (ascending, all before the
  target's last layer), final as for eagle1. EAGLE-3's own layer
  also widens attention's input to 2H; this one keeps EAGLE-1's ``fc``.

``d2t[j]`` is the target id of draft id j (strictly ascending). Dependencies: torch, safetensors,
json, transformers' ``PretrainedConfig`` and ``pagedspec.engine.models.hf_config``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from pagedspec.engine.models.hf_config import model_config_from_dict

ARCHITECTURES = ("eagle1", "eagle3")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
CONFIG_FIELDS = ("architecture", "hidden_size", "draft_vocab_size", "target_vocab_size",
                 "target_model", "layer_config")  # fmt: skip
LAYER_CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act",
    "model_type", "attention_bias", "mlp_bias",
)  # fmt: skip
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_config_from_hf(config: Any) -> dict:
    """The ``layer_config`` of a head for a HF Llama-family target config (transformers 4.x
    ``rope_theta`` / ``rope_scaling`` or 5.x ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        theta = params["rope_theta"]
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling = None if rest.get("rope_type", "default") == "default" else rest
    else:
        theta, scaling = config.rope_theta, getattr(config, "rope_scaling", None)
    heads = config.num_attention_heads
    return {
        "hidden_size": int(config.hidden_size),
        "intermediate_size": int(config.intermediate_size),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        "rms_norm_eps": float(config.rms_norm_eps),
        "rope_theta": float(theta),
        "rope_scaling": dict(scaling) if scaling else None,
        "max_position_embeddings": int(config.max_position_embeddings),
        "hidden_act": str(config.hidden_act),
        "model_type": str(config.model_type),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }


def layer_model_config(layer_config: dict) -> PretrainedConfig:
    """The config of a one-layer Llama model, for building the engine's head layer."""
    fields = {k: layer_config[k] for k in LAYER_CONFIG_FIELDS if k != "model_type"}
    return model_config_from_dict({**fields, "model_type": "llama", "num_hidden_layers": 1})


def llama_config(layer_config: dict):
    """The same as a ``transformers.LlamaConfig``, for HF's decoder layer (training, tests)."""
    from transformers import LlamaConfig

    fields = {k: layer_config[k] for k in LAYER_CONFIG_FIELDS if k != "model_type"}
    return LlamaConfig(num_hidden_layers=1, **fields)


def make_config(
    layer_config: dict,
    draft_vocab_size: int,
    target_vocab_size: int,
    target_model: str,
    feature_layers: tuple[int, ...] = (),
) -> dict:
    """An ``eagle1`` config, or an ``eagle3`` one with ``feature_layers``."""
    config = {
        "architecture": "eagle3" if feature_layers else "eagle1",
        "hidden_size": layer_config["hidden_size"],
        "draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": int(target_vocab_size),
        "target_model": str(target_model),
        "layer_config": dict(layer_config),
    }
    if feature_layers:
        config["feature_layers"] = [int(i) for i in feature_layers]
    check_config(config)
    return config


def feature_layers(config: dict) -> tuple[int, ...]:
    """The target layers whose hidden states a checked config's head reads (eagle1: none)."""
    return tuple(config.get("feature_layers", ()))


def feature_layers_fit(layers: tuple[int, ...], num_layers: int) -> bool:
    """Whether a head may read ``layers`` of a target of ``num_layers``: every layer but the last
    (whose hidden state the final one already is, up to its norm)."""
    return not layers or layers[-1] < num_layers - 1


def _positive_int(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config {name} must be a positive integer, got {value!r}")


def check_config(config: dict) -> None:
    """Raise ValueError naming the first missing or inconsistent field."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    missing = [f for f in CONFIG_FIELDS if f not in config]
    if missing:
        raise ValueError(f"config is missing {missing}")
    if config["architecture"] not in ARCHITECTURES:
        raise ValueError(
            f"config architecture must be one of {ARCHITECTURES}, got {config['architecture']!r}"
        )
    layers = config.get("feature_layers")
    if config["architecture"] == "eagle1" and layers is not None:
        raise ValueError("config feature_layers is for architecture 'eagle3' only")
    if config["architecture"] == "eagle3" and (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        or layers != sorted(set(layers))
    ):
        raise ValueError(
            f"config feature_layers must be a non-empty ascending list of layer indices >= 0, "
            f"got {layers!r}"
        )
    for name in ("hidden_size", "draft_vocab_size", "target_vocab_size"):
        _positive_int(config[name], name)
    if config["draft_vocab_size"] > config["target_vocab_size"]:
        raise ValueError(
            f"config draft_vocab_size ({config['draft_vocab_size']}) exceeds "
            f"target_vocab_size ({config['target_vocab_size']})"
        )
    if not isinstance(config["target_model"], str):
        raise ValueError("config target_model must be a string")
    layer = config["layer_config"]
    if not isinstance(layer, dict):
        raise ValueError("config layer_config must be a dict")
    missing = [f for f in LAYER_CONFIG_FIELDS if f not in layer]
    if missing:
        raise ValueError(f"config layer_config is missing {missing}")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        _positive_int(layer[name], f"layer_config.{name}")
    if layer["hidden_size"] != config["hidden_size"]:
        raise ValueError(
            f"config hidden_size ({config['hidden_size']}) != layer_config.hidden_size "
            f"({layer['hidden_size']})"
        )
    if layer["num_attention_heads"] % layer["num_key_value_heads"]:
        raise ValueError(
            "config layer_config.num_attention_heads must be a multiple of num_key_value_heads"
        )
    if layer["attention_bias"] or layer["mlp_bias"]:
        raise ValueError("config layer_config: attention_bias and mlp_bias must be false")
    if layer["rope_scaling"] is not None and not isinstance(layer["rope_scaling"], dict):
        raise ValueError("config layer_config.rope_scaling must be null or a dict")


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, for a checked config."""
    layer = config["layer_config"]
    h, inter = layer["hidden_size"], layer["intermediate_size"]
    q = layer["num_attention_heads"] * layer["head_dim"]
    kv = layer["num_key_value_heads"] * layer["head_dim"]
    vd = config["draft_vocab_size"]
    fused = len(feature_layers(config))
    return {
        **({"fuse.weight": (h, (fused + 1) * h)} if fused else {}),
        "fc.weight": (h, 2 * h),
        "layer.self_attn.q_proj.weight": (q, h),
        "layer.self_attn.k_proj.weight": (kv, h),
        "layer.self_attn.v_proj.weight": (kv, h),
        "layer.self_attn.o_proj.weight": (h, q),
        "layer.mlp.gate_proj.weight": (inter, h),
        "layer.mlp.up_proj.weight": (inter, h),
        "layer.mlp.down_proj.weight": (h, inter),
        "layer.input_layernorm.weight": (h,),
        "layer.post_attention_layernorm.weight": (h,),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),
    }


def check_state_dict(state_dict: dict[str, torch.Tensor], config: dict) -> None:
    """Raise ValueError naming missing or unexpected tensors, wrong shapes or dtypes, or a
    ``d2t`` that is not a strictly ascending list of target ids."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"head tensors: missing {missing}, unexpected {unexpected}")
    for name, shape in shapes.items():
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"head tensor {name} is a {type(tensor).__name__}, not a Tensor")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"head tensor {name} has shape {tuple(tensor.shape)}, want {shape}")
        if name == "d2t":
            if tensor.dtype != torch.int64:
                raise ValueError(f"head tensor d2t must be int64, got {tensor.dtype}")
        elif tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"head tensor {name} has dtype {tensor.dtype}, want a float dtype")
    d2t = state_dict["d2t"]
    if len(d2t) and (int(d2t[0]) < 0 or int(d2t[-1]) >= config["target_vocab_size"]):
        raise ValueError(f"head d2t holds ids outside [0, {config['target_vocab_size']})")
    if len(d2t) > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
        raise ValueError("head d2t must be strictly ascending (sorted, no duplicates)")


def save_head(
    path: str, state_dict: dict[str, torch.Tensor], config: dict, manifest: dict | None = None
) -> None:
    """Check, then write ``model.safetensors``, ``config.json`` and (if given) ``manifest.json``
    into directory ``path`` (created if needed). Each file is written then renamed into place."""
    check_config(config)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    check_state_dict(tensors, config)
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, WEIGHTS_FILE)
    metadata = {"format": "pt", "architecture": config["architecture"]}
    save_file(tensors, weights + ".tmp", metadata=metadata)
    os.replace(weights + ".tmp", weights)
    _write_json(os.path.join(path, CONFIG_FILE), config)
    if manifest is not None:
        _write_json(os.path.join(path, MANIFEST_FILE), manifest)


def load_head(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state_dict, config) of the head in directory ``path``, checked against each other.
    Tensors keep their stored dtype (``d2t`` is int64)."""
    config_path = os.path.join(path, CONFIG_FILE)
    weights = os.path.join(path, WEIGHTS_FILE)
    for file in (config_path, weights):
        if not os.path.isfile(file):
            raise ValueError(f"not an EAGLE head directory: {file} is missing")
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    check_config(config)
    state_dict = load_file(weights)
    check_state_dict(state_dict, config)
    return state_dict, config


def load_manifest(path: str) -> dict | None:
    file = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def _write_json(file: str, value: dict) -> None:
    with open(file + ".tmp", "w") as f:
        json.dump(value, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(file + ".tmp", file)
