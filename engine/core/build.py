"""Builds an engine's parts from its config: models, KV caches, runners and the step's owners."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from pagedspec import kernels
from pagedspec.engine.config import EngineConfig, SpeculativeConfig
from pagedspec.engine.core.graph_capture import CudaGraphCapture, capture_graphs, uses_cuda_graphs
from pagedspec.engine.core.output_processor import OutputProcessor
from pagedspec.engine.core.processor import Processor
from pagedspec.engine.distributed.shard import NO_TP, check_tp_shapes
from pagedspec.engine.loader.model_loader import load_model_config, model_kv_shape
from pagedspec.engine.sample.grammar import Grammars
from pagedspec.engine.sample.round import NoSpeculation
from pagedspec.engine.sample.sampler import Sampler
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.engine.worker.cpu_threads import ThreadGovernor, affinity, cpu_limit
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.model_set import (
    kv_cache_dtype,
    load_model_set,
    make_runner,
    rank_device,
)
from pagedspec.engine.worker.tp_group import DistributedRunner, TPGroup
from pagedspec.memory import BlockManager, kv_block_bytes
from pagedspec.scheduler import Scheduler, SchedulerConfig

# On CPU, KV defaults to this fraction of available RAM (capped by what the limits can use).
_CPU_KV_MEMORY_FRACTION = 0.3
# Block tables can outgrow max_model_len by a partial block and lookahead slots; the warm-up
# plans for this much more (a variant compiled needlessly costs seconds once, a missed one
# stalls serving).
_WARMUP_CONTEXT_SLACK = 512


@dataclass(frozen=True)
class EngineParts:
    tokenizer: PreTrainedTokenizerBase | None
    model_config: PretrainedConfig
    processor: Processor
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner | DistributedRunner
    spec: NoSpeculation  # or spec_decode's Speculation
    step_sampler: StepSampler
    output_processor: OutputProcessor
    tp: TPGroup | None  # the tensor-parallel workers (None: one device)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Rank 0's parts. With ``tensor_parallel_size`` > 1 the workers are started first and
    every model is this rank's shard; its runners mirror each call to the workers."""
    device = rank_device(config, 0)
    if device.type == "cpu":  # (a tensor-parallel group divides these among its ranks)
        torch.set_num_threads(config.num_threads or cpu_limit())
    if config.tensor_parallel_size == 1:
        return _build(config, device, None)
    spec = config.speculative_config
    if spec is not None and spec.method == "eagle":
        raise ValueError("speculative method 'eagle' needs tensor_parallel_size 1")
    _check_tp(config)
    tp = TPGroup(config, device)
    try:
        return _build(config, device, tp)
    except BaseException:
        tp.shutdown()
        raise


def _check_tp(config: EngineConfig) -> None:
    """Refuse a model whose heads cannot be split before any worker starts."""
    spec = config.speculative_config
    paths = [config.model] + ([spec.draft_model] if spec and spec.method == "draft" else [])
    for path in paths:
        check_tp_shapes(load_model_config(path), config.tensor_parallel_size)


def _build(config: EngineConfig, device: torch.device, tp: TPGroup | None) -> EngineParts:
    shard = NO_TP if tp is None else tp.shard
    models = load_model_set(config, device, shard)
    target, draft = models.target, models.draft
    vocab_size = int(target.config.vocab_size)
    dtype = next(target.model.parameters()).dtype
    model_max = target.model.max_model_len
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len must be <= {model_max} for this model, got {config.max_model_len}"
        )
    max_model_len = config.max_model_len or model_max
    eos_token_ids = _eos_token_ids(target.config, target.tokenizer)

    spec = config.speculative_config
    head = None
    if spec is not None and spec.method == "eagle":
        from pagedspec.engine.spec_decode.eagle import load_eagle_head  # (see _proposer)

        head = load_eagle_head(spec.draft_model, target, dtype, device)
    kv_shapes = [model_kv_shape(m.config, shard) for m in [target] + ([draft] if draft else [])]
    if head is not None:
        kv_shapes.append(model_kv_shape(head.config))
    num_blocks = _num_blocks(
        config, kv_shapes, max_model_len, kv_cache_dtype(config, dtype), device
    )
    if tp is not None:
        tp.ready(num_blocks)

    def runner(model: nn.Module, model_config: PretrainedConfig, index: int):
        local = make_runner(model, model_config, config, num_blocks, shard)
        # Compile every Triton variant now, not mid-serving (a no-op off CUDA).
        max_context = max_model_len + _WARMUP_CONTEXT_SLACK
        heads = int(model_config.num_attention_heads) // shard.size
        kernels.warmup(
            heads, *local.kv_caches[0], max_context, config.attention_backend, query_dtype=dtype,
            trees=index == 0 and spec is not None and spec.draft_leaves > 0,  # the target verifies
        )  # fmt: skip
        if index == 0 and tp is None and device.type == "cpu" and config.num_threads is None:
            limit = torch.get_num_threads()
            local.threads = ThreadGovernor(limit, spare=max(0, affinity() - limit))
        return local if tp is None else DistributedRunner(local, index, tp)

    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler_config = SchedulerConfig(
        config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.scheduling_policy
    )
    proposer = None
    if spec is not None:
        drafter = None  # the runner of a draft model or EAGLE head
        if draft is not None:
            drafter = runner(draft.model, draft.config, 1)
        elif head is not None:
            drafter = runner(head, head.config, 1)
        proposer = _proposer(config, spec, draft is not None, drafter)
    step_sampler = StepSampler(Sampler(config.seed, device), eos_token_ids, cpu_limit())
    grammars = None
    if target.tokenizer is not None:
        grammars = Grammars(target.tokenizer, vocab_size, eos_token_ids)
    target_runner = runner(target.model, target.config, 0)
    if tp is None and uses_cuda_graphs(config, device):
        eagle = proposer if head is not None else None
        capture_graphs(config, max_model_len, target_runner, eagle, CudaGraphCapture())
    speculation = NoSpeculation(step_sampler)
    if proposer is not None:
        from pagedspec.engine.spec_decode.speculation import Speculation

        speculation = Speculation(spec, proposer, step_sampler, target_runner, max_model_len)
    return EngineParts(
        tokenizer=target.tokenizer,
        model_config=target.config,
        processor=Processor(
            target.tokenizer,
            vocab_size,
            max_model_len,
            config.max_num_seqs,
            num_blocks,
            config.block_size,
            0 if spec is None else spec.num_speculative_tokens,
            grammars,
        ),
        block_manager=block_manager,
        scheduler=Scheduler(scheduler_config, block_manager),
        runner=target_runner,
        spec=speculation,
        step_sampler=step_sampler,
        output_processor=OutputProcessor(target.tokenizer, eos_token_ids, max_model_len, grammars),
        tp=tp,
    )


def _proposer(
    config: EngineConfig,
    spec: SpeculativeConfig,
    is_draft_model: bool,
    runner: ModelRunner | DistributedRunner | None,
):
    """The drafter ``spec`` names; ``runner`` runs its draft model or EAGLE head (None for
    n-gram). spec_decode is imported only here and where the head loads, so an engine without
    speculation never loads it."""
    from pagedspec.engine.spec_decode.eagle import EagleProposer
    from pagedspec.engine.spec_decode.proposers import DraftModelProposer, NgramProposer

    seed, confidence = config.seed + 1, spec.min_draft_confidence
    if runner is None:
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if is_draft_model:
        return DraftModelProposer(runner, seed, confidence)
    return EagleProposer(runner, seed, confidence, spec.draft_leaves)


def _num_blocks(
    config: EngineConfig,
    kv_shapes: list[tuple[int, int, int]],
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = sum(kv_block_bytes(*shape, config.block_size, dtype) for shape in kv_shapes)
    needed = config.max_num_seqs * -(-max_model_len // config.block_size)
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.8)
        else:
            budget = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
            # the ranks of a tensor-parallel group share this machine's memory
            budget = int(budget * _CPU_KV_MEMORY_FRACTION) // config.tensor_parallel_size
    return max(1, min(needed, budget // per_block))


def _eos_token_ids(model_config: PretrainedConfig, tokenizer) -> set[int]:
    ids = getattr(model_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list | tuple) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
