"""pagedspec.engine.models.hf_config against transformers' own config classes: every field the
engine reads, and what the engine derives from them (head dim, window, rope frequencies, EOS
ids)."""

import pytest
from loading_imports import CONFIG_CHAIN, imported_after_loading
from transformers import AutoConfig

from pagedspec.engine.core.build import _eos_token_ids
from pagedspec.engine.models import SUPPORTED_MODEL_TYPES
from pagedspec.engine.models.hf_config import (
    _CLASSES,
    _DEFAULTS,
    model_config_from_dict,
    read_model_config,
)
from pagedspec.engine.models.layers import RotaryEmbedding, _rope_parameters
from pagedspec.engine.models.llama import head_dim_of, sliding_window_of
from pagedspec.engine.spec_decode import eagle_format

FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "pad_token_id",
)  # fmt: skip
OPTIONAL = {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}

SMALL = {"hidden_size": 256, "num_attention_heads": 32, "num_hidden_layers": 4}
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
CASES = [
    {},
    SMALL,
    {**SMALL, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True},
    {**SMALL, "rope_theta": 5e5, "rms_norm_eps": 1e-5, "eos_token_id": [7, 9]},  # GGUF-style
    {**SMALL, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}},  # transformers 5
    {**SMALL, "rope_scaling": dict(LLAMA3_ROPE), "rope_theta": 5e5, "max_position_embeddings": 512},
    {**SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}},  # transformers 4, old key
    {**SMALL, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 256},
    {**SMALL, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},  # not run: same error
    {**SMALL, "sliding_window": None},
    {**SMALL, "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2},
    {**SMALL, "sliding_window": 32, "use_sliding_window": False},
    {**SMALL, "attention_bias": True, "mlp_bias": True, "pad_token_id": 0, "bos_token_id": 5},
]


def engine_view(config) -> dict:
    view = {name: getattr(config, name) for name in FIELDS}
    view |= {name: bool(getattr(config, name, default)) for name, default in OPTIONAL.items()}
    head_dim = head_dim_of(config)
    try:
        rope = RotaryEmbedding(config, head_dim)
        view |= {"inv_freq": rope.inv_freq.tolist(), "rope_scaling_factor": rope.scaling}
    except ValueError as e:  # a rope type the engine does not run: the same error
        view["rope_error"] = str(e)
    view |= {
        "head_dim": head_dim,
        "sliding_window": sliding_window_of(config),
        "rope": _rope_parameters(config),
        "eos": _eos_token_ids(config, None),
    }
    return view


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fields_the_engine_reads_match_transformers(model_type: str, case: int, tmp_path) -> None:
    raw = {"model_type": model_type, **CASES[case]}
    ours = model_config_from_dict(raw)
    theirs = AutoConfig.for_model(**{k: v for k, v in raw.items()})
    assert engine_view(ours) == engine_view(theirs)
    assert raw == {"model_type": model_type, **CASES[case]}  # the caller's dict is untouched
    # saved, it reloads as the model's own class, and as itself, with the same fields
    ours.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert type(reloaded) is type(theirs)
    assert engine_view(reloaded) == engine_view(theirs)
    assert engine_view(read_model_config(str(tmp_path))) == engine_view(theirs)


def test_one_model_type_list() -> None:
    assert tuple(_DEFAULTS) == tuple(_CLASSES) == SUPPORTED_MODEL_TYPES


def test_unsupported_model_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: \["):
        model_config_from_dict({"model_type": "gpt2"})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "64", "hidden_size must be a positive integer, got '64'"),
        ("vocab_size", 2.5, "vocab_size must be a positive integer, got 2.5"),
        ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
        ("num_hidden_layers", True, "num_hidden_layers must be a positive integer, got True"),
        ("head_dim", -16, "head_dim must be a positive integer, got -16"),
        ("rms_norm_eps", -1.0, "rms_norm_eps must be a positive number, got -1.0"),
        ("num_key_value_heads", 5, r"num_attention_heads \(32\) must be a multiple of num_key_va"),
    ],
)
def test_a_shape_the_model_cannot_have_is_a_value_error(field, value, message) -> None:
    with pytest.raises(ValueError, match=f"^config {message}"):
        model_config_from_dict({"model_type": "llama", **SMALL, field: value})


def test_reads_a_saved_config_and_keeps_unknown_fields(tmp_path) -> None:
    theirs = AutoConfig.for_model("qwen3", **SMALL, vocab_size=128, head_dim=16)
    theirs.save_pretrained(tmp_path)
    ours = read_model_config(str(tmp_path))
    assert engine_view(ours) == engine_view(theirs)
    assert ours.initializer_range == theirs.initializer_range
    assert ours._name_or_path == str(tmp_path)
    assert read_model_config(str(tmp_path / "config.json")).vocab_size == 128


def test_loading_a_model_imports_no_model_config_module(tiny_llama) -> None:
    """The point of the module: loading a model and its tokenizer pulls in neither
    transformers' model configs nor, through them, torch.distributed.tensor and sympy (51 MiB
    resident)."""
    assert imported_after_loading(tiny_llama, (*CONFIG_CHAIN, "transformers.models.llama")) == []


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_eagle_layer_config_matches_llama_config(rope_scaling) -> None:
    theirs = AutoConfig.for_model("llama", **SMALL, num_key_value_heads=2, intermediate_size=96)
    layer = eagle_format.layer_config_from_hf(theirs)
    layer["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    view = engine_view(eagle_format.layer_model_config(layer))
    assert view == engine_view(eagle_format.llama_config(layer))
    assert view["num_hidden_layers"] == 1
