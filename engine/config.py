"""Engine and speculation configuration: frozen, validated dataclasses (LLM keyword arguments)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "xformers")
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
# None: weights as loaded. Weight-only GGUF block formats (pagedspec.engine.models.quant), CPU
# float32: "int8": Q8_0; "q4_1": Q4_1 (the LM head Q8_0, as llama.cpp's Q4_1 files ship it).
QUANTIZATIONS = (None, "int8", "q4_1")
# "auto": the KV cache in the model's dtype. A 16-bit cache under a float32 model halves the
# bytes attention reads (llama.cpp keeps F16 KV by default); keys and values are rounded to
# nearest when written, and attention still computes in float32.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# scheduler.POLICIES (not imported here: the scheduler package imports torch, and the CLIs read
# this module before torch loads); tests/engine/core/test_engine.py checks the two agree
SCHEDULING_POLICIES = ("fcfs", "priority")


# The defaults of the SpeculativeConfig fields that None leaves to the method: the one place they
# are set (--help reads them, README quotes them; each field's meaning: SpeculativeConfig). Chosen
# on a 2-core CPU (benchmarks/spec_decode.py); where verifying a wider step is free (a GPU), raise
# disable_batch_size.
METHOD_DEFAULTS: dict[str, dict[str, int | float]] = {
    # n-gram and draft models: drafts back off after failed rounds; chains run to k
    "ngram": {
        "disable_batch_size": 16,
        "max_draft_skip": 16,
        "min_draft_confidence": 0.0,
        "draft_leaves": 0,
    },
    "draft": {
        "disable_batch_size": 16,
        "max_draft_skip": 16,
        "min_draft_confidence": 0.0,
        "draft_leaves": 0,
    },
    # EAGLE: off at smaller batches (its leaves and head cost rows per sequence); no backoff (the
    # chain stop already drafts little where the head is unsure); a draft tree
    "eagle": {
        "disable_batch_size": 4,
        "max_draft_skip": 0,
        "min_draft_confidence": 0.2,
        "draft_leaves": 3,
    },
}
# Attention backends without tree masks: there draft_leaves defaults to 0 (chains only) and an
# explicit draft_leaves > 0 is refused (EngineConfig).
NO_TREE_BACKENDS = ("xformers",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed. ``disable_batch_size``, ``max_draft_skip``,
    ``min_draft_confidence`` and ``draft_leaves`` left None (or passed as None) take the method's
    default from ``METHOD_DEFAULTS`` when the config is built, so they always hold a value.

    ``disable_batch_size``: speculation is switched off for a step when at least this many
    sequences are running or waiting. Verifying k drafts costs (k+1)x the target's tokens, free
    only while a step is memory-bound; raise it where a step stays memory-bound to larger batches
    (a GPU), lower it where speculation loses at small batches (``benchmarks/spec_decode.py``
    measures the crossover).

    ``max_draft_skip``: after a verification round that accepted nothing, a sequence skips
    drafting for 1, 2, 4, ... steps, at most this many (``pagedspec.engine.spec_decode.backoff``); 0
    drafts every step. Lower it for prompts that are drafted well; raise it where drafts fail.

    ``min_draft_confidence``: a draft model or head stops a sequence's chain once the product
    of its drafts' top-1 probabilities falls below this (EAGLE-2's dynamic draft length: a
    draft past that point is rarely accepted and costs a drafter forward and a verified row);
    the first draft is always made; 0 runs every chain to k. Which drafts are made depends on q
    alone, never on the target's p, so verification stays exact.

    ``draft_leaves`` (eagle): this many more of the head's tokens are verified as leaves beside
    the chain, in the same forward (a draft tree: ``pagedspec.engine.spec_decode.tree``). At every
    depth the chain reaches, the head's next-best tokens there are candidates, each scored by the
    probability of its path: the product of the chain's top-1 probabilities above it, times its
    own (EAGLE-2's ranking: a leaf goes where the head expects the chain to be rejected, most
    often beside an unsure first draft); the best-scored ones are verified. Where the chain is
    rejected at a depth whose leaf holds the token the target emits instead, the leaf's row
    gives one more token. 0 verifies chains only. Each leaf costs a verified row: more pay
    where a row is cheap. Under an attention backend without tree masks (``NO_TREE_BACKENDS``)
    the default is 0 (``EngineConfig``).
    ``disable_tree_batch_size``: the leaves are left out (chains alone) in steps with at least
    this many running or waiting sequences.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    # "draft": a model directory or .gguf; "eagle": a head directory (None: the head shipped
    # for the default model)
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    disable_batch_size: int | None = None  # None: METHOD_DEFAULTS
    max_draft_skip: int | None = None  # None: METHOD_DEFAULTS
    # A draft model or head samples its drafts from q at temperature > 0 (verified by
    # min(1, p/q)); False drafts the argmax instead (verified as deterministic drafts), as
    # it always does for a seeded request (whose tokens then do not depend on the drafts).
    sample_drafts: bool = True
    min_draft_confidence: float | None = None  # None: METHOD_DEFAULTS
    draft_leaves: int | None = None  # None: METHOD_DEFAULTS
    # From this many busy sequences a leaf's verified row costs more than it gains: chains only.
    disable_tree_batch_size: int = 2

    def __post_init__(self) -> None:
        _one_of("method", self.method, SPECULATIVE_METHODS)
        for name, default in METHOD_DEFAULTS[self.method].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("ngram_min", self.ngram_min)
        if not isinstance(self.ngram_max, int) or self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max must be an integer >= ngram_min, got {self.ngram_max!r}")
        _positive("disable_batch_size", self.disable_batch_size)
        _positive("disable_tree_batch_size", self.disable_tree_batch_size)
        skip = self.max_draft_skip
        if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
            raise ValueError(f"max_draft_skip must be an integer >= 0, got {skip!r}")
        if not isinstance(self.sample_drafts, bool):
            raise ValueError(f"sample_drafts must be a bool, got {self.sample_drafts!r}")
        c = self.min_draft_confidence
        if not (isinstance(c, int | float) and 0.0 <= c <= 1.0):
            raise ValueError(f"min_draft_confidence must be in [0, 1], got {c!r}")
        object.__setattr__(self, "min_draft_confidence", float(c))
        if self.method == "draft" and not self.draft_model:
            raise ValueError("draft_model is required when method='draft'")
        leaves = self.draft_leaves
        if not isinstance(leaves, int) or isinstance(leaves, bool) or leaves < 0:
            raise ValueError(f"draft_leaves must be an integer >= 0, got {leaves!r}")
        if leaves and self.method != "eagle":
            raise ValueError(f"draft_leaves needs method='eagle', got {self.method!r}")
        # (kernels imports torch: the flags are checked before it loads, see
        # pagedspec.engine.entrypoints.generate)
        from pagedspec.kernels.tree_mask import MAX_TREE_TOKENS

        if leaves and self.num_speculative_tokens + leaves >= MAX_TREE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens + draft_leaves must be < {MAX_TREE_TOKENS} "
                f"(one verified span), got {self.num_speculative_tokens + leaves}"
            )

    @classmethod
    def of(
        cls, value: SpeculativeConfig | dict[str, Any] | None, attention_backend: str = "auto"
    ) -> SpeculativeConfig | None:
        """``value`` as a config. A dict's ``draft_leaves``, when missing or None, is 0 under an
        ``attention_backend`` without tree masks (``NO_TREE_BACKENDS``); a SpeculativeConfig
        already holds its values and is returned as it is."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            if attention_backend in NO_TREE_BACKENDS and value.get("draft_leaves") is None:
                value = {**value, "draft_leaves": 0}
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig or dict, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default model; a HF model directory; or a .gguf file
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from free memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    speculative_config: SpeculativeConfig | dict | None = None
    load_format: str = "auto"
    seed: int = 0
    kv_cache_memory: int | None = None  # bytes for KV when num_kv_blocks is None
    # Ranks the model is split over (pagedspec.engine.distributed): rank 0 is this process, the
    # others are spawned here, or join from other machines when WORLD_SIZE is set in the
    # environment.
    tensor_parallel_size: int = 1
    # Weight-only quantisation of every Linear (QUANTIZATIONS): "int8" quantises each weight
    # at load to GGUF Q8_0, "q4_1" to Q4_1 but the LM head to Q8_0 (a Q8_0 / Q4_1 GGUF file's
    # tensors keep their shipped values bit for bit: the default model runs its file's numbers).
    quantization: str | None = None
    # KV_CACHE_DTYPES: "auto", the model's dtype, or a 16-bit cache under a float32 model.
    kv_cache_dtype: str = "auto"
    # CUDA: decode and verification steps replay graphs captured at start-up
    # (pagedspec.engine.worker.cuda_graphs) unless True.
    enforce_eager: bool = False
    # CPU: the kernels' threads. None: the CPUs free to this process (affinity mask, cgroup
    # quota), fewer while other processes keep some of them busy
    # (pagedspec.engine.worker.cpu_threads).
    num_threads: int | None = None
    # "fcfs", or "priority": requests by add_request's priority (lower first, ties by arrival),
    # and under memory pressure the lowest-priority running sequence is preempted first.
    scheduling_policy: str = "fcfs"
    # Async scheduling (pagedspec.engine.core.async_step): the host schedules and launches step
    # N + 1 before it reads step N's tokens, so on CUDA it works while the device runs. Steps
    # whose rows read nothing but their tokens (others run synchronously); no speculation or TP.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        spec = SpeculativeConfig.of(self.speculative_config, self.attention_backend)
        if spec is not None and self.attention_backend in NO_TREE_BACKENDS and spec.draft_leaves:
            raise ValueError(
                f"draft_leaves needs tree masks, which attention_backend "
                f"{self.attention_backend!r} lacks (triton, cpu and torch have them), got "
                f"{spec.draft_leaves}: set it to 0, or leave it unset in a dict speculative_config"
            )
        object.__setattr__(self, "speculative_config", spec)
        if self.async_scheduling and (spec is not None or self.tensor_parallel_size > 1):
            raise ValueError(
                "async_scheduling needs speculative_config None and tensor_parallel_size 1 "
                f"(got {spec and spec.method!r} and {self.tensor_parallel_size})"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)


def _one_of(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
