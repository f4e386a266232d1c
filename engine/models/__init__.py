"""Model definitions, chosen by ``config.model_type``: modules from token ids, positions and
the paged KV cache to hidden states and logits. They know no scheduler, runner or sampling;
tensor parallelism reaches them only as a ``TPShard`` (``parallel``: the layers that end in a
collective)."""

from torch import nn
from transformers import PretrainedConfig

from pagedspec.engine.models.attention import AttentionMetadata
from pagedspec.engine.models.llama import LlamaForCausalLM

# One implementation covers the whole Llama family; config flags select the differences.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(_MODEL_CLASSES)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The nn.Module class for ``config.model_type``; ValueError for anything unsupported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_CLASSES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return _MODEL_CLASSES[model_type]


__all__ = ["SUPPORTED_MODEL_TYPES", "AttentionMetadata", "LlamaForCausalLM", "get_model_class"]
