"""The models a rank runs (the target and, for draft-model speculation, the draft) and their
runners: what rank 0's engine build and a tensor-parallel worker share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.distributed.shard import NO_TP, TPShard
from pagedspec.engine.loader.model_loader import (
    LoadedModel,
    load_model,
    model_kv_shape,
    resolve_device,
)
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.kernels.checks import cache_holds
from pagedspec.memory import allocate_kv_caches


@dataclass(frozen=True)
class ModelSet:
    target: LoadedModel
    draft: LoadedModel | None  # speculative_config.method == "draft"


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The configured device; on CUDA, GPU ``local_rank`` (one GPU per rank on a machine)."""
    device = resolve_device(config.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def load_model_set(config: EngineConfig, device: torch.device, shard: TPShard = NO_TP) -> ModelSet:
    """Load this rank's share of the target (and draft) model."""

    def load(path: str | None) -> LoadedModel:  # the target and a draft load alike
        return load_model(path, config.dtype, device, config.load_format, config.seed, shard,
                          config.quantization)  # fmt: skip

    target = load(config.model)
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft":
        draft = load(spec.draft_model)
        vocab_size = int(target.config.vocab_size)
        if int(draft.config.vocab_size) != vocab_size:
            raise ValueError(
                f"draft_model vocabulary ({draft.config.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); speculation needs the same vocabulary"
            )
    return ModelSet(target, draft)


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model computing in ``model_dtype`` (config.kv_cache_dtype)."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, config.kv_cache_dtype)
    if not cache_holds(model_dtype, dtype):
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype!r} needs a float32 model or one of its own "
            f"dtype; this model computes in {model_dtype} (use 'auto')"
        )
    if dtype != model_dtype and config.attention_backend == "xformers":
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype!r} differs from the model's {model_dtype}, "
            f"which attention_backend 'xformers' cannot read (use 'auto' or 'triton')"
        )
    return dtype


def make_runner(
    model: nn.Module,
    model_config: PretrainedConfig,
    config: EngineConfig,
    num_blocks: int,
    shard: TPShard = NO_TP,
) -> ModelRunner:
    """A runner over ``num_blocks`` KV blocks holding this rank's KV heads of ``model``."""
    param = next(model.parameters())
    caches = allocate_kv_caches(
        *model_kv_shape(model_config, shard),
        num_blocks,
        config.block_size,
        kv_cache_dtype(config, param.dtype),
        param.device,
    )
    return ModelRunner(model, caches, config.attention_backend, param.device)
