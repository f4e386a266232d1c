"""Engine and speculation configuration: frozen, validated dataclasses (LLM keyword arguments)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kernels.reference import MAX_TREE_TOKENS

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "xformers")
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
# None: weights as loaded. Weight-only GGUF block formats (engine.models.quant), CPU float32:
# "int8": Q8_0; "q4_1": Q4_1 (the LM head Q8_0, as llama.cpp's Q4_1 files ship it).
QUANTIZATIONS = (None, "int8", "q4_1")
# "auto": the KV cache in the model's dtype. A 16-bit cache under a float32 model halves the
# bytes attention reads (llama.cpp keeps F16 KV by default); keys and values are rounded to
# nearest when written, and attention still computes in float32.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ChainStop:
    """A drafter's chain stop (``SpeculativeConfig.min_draft_confidence``): the threshold for a
    greedy request's chain, and for a sampled one's."""

    greedy: float = 0.0
    sampled: float = 0.0

    def threshold(self, greedy: bool) -> float:
        return self.greedy if greedy else self.sampled


# The shipped head's chain stop, chosen on held-out chat prompts 8-39 (the benchmark measures
# 0-7) at batch 1, k=4, each threshold against no speculation in one process, twice over:
# greedy 0.2 gave 1.56x and 1.55x where 0.3 gave 1.52x and 1.49x (0.15: 1.46x); at temperature
# 0.8, where the raw top-1 probability overstates a sampled draft's acceptance, 0.3 gave 1.20x
# and 1.24x, 0.2 1.16x and 1.17x. The margins are within this CPU's run-to-run noise: on
# prompts 0-7 greedy 0.3 led by ~2% (the sweep script and its runs: issue 14's notes). Once the
# float32 GEMM prefetched its weights (a verified row costing less) and the tree took three
# leaves, sampled chains stopping at 0.2 beat 0.3 on the step-6 head (Intel Xeon, temperature
# 0.8, prompts 9-32 / 33-64: 1.43x / 1.43x against 1.42x / 1.39x), and greedy 0.2 beat 0.1
# (prompts 9-40: 1.68x against 1.67x), so both stop at 0.2.
DEFAULT_CHAIN_STOP = ChainStop(greedy=0.2, sampled=0.2)
NO_CHAIN_STOP = ChainStop()  # every chain runs to k
# The shipped head's draft tree: three leaves beside its chain, placed by score (two until the
# GEMM prefetch below). Measured at batch 1, k=4, on held-out chat prompts 8-39 (the benchmark
# measures 0-7), every configuration taking
# turns on each prompt against no speculation (python -m benchmarks.eagle_sweep; the previous
# tree by a script that emulated it, in issue 14's notes). Greedy, two passes over 8-23 / 24-39:
# scored 1.46x / 1.50x, the first draft's 2nd and 3rd choices (the previous default) 1.44x /
# 1.49x, chains only 1.45x / 1.44x, three scored leaves 1.45x / 1.47x; temperature 0.8 (8-23):
# 1.35x, 1.34x, 1.31x and 1.29x. Drafting k=4 always (8-23), tokens per verification: 2.42
# scored, 2.32 the previous tree, 2.56 with three leaves, 1.96 chains. A leaf costs a verified
# row, ~0.2-0.5 ms on this CPU as its memory is fast or slow. With the step-6 head on 2 cores of
# an Intel Xeon with AMX (prompts 9-40, greedy, two passes, --eagle-head the new head): two
# leaves 1.49x, three 1.48x, four 1.44x (the step-5 head with two: 1.42x); drafting k=4 always,
# 2.26 / 2.34 / 2.38 tokens per verification (step 5: 2.15). Then the float32 GEMM learned to
# prefetch its weights, and 7 rows cost 1.1x a decode step's one instead of 1.3x: on the same
# Xeon, greedy (prompts 9-40) two leaves 1.65x, three 1.68x, four 1.66x; temperature 0.8 (9-32)
# two 1.38x, three 1.42x, and (33-64) three 1.39x, four 1.38x. Three it is.
DEFAULT_DRAFT_LEAVES = 3
DEFAULT_MAX_DRAFT_SKIP = 16  # n-gram and draft models (eagle: 0, see SpeculativeConfig)
# Speculation is off from this many busy sequences (SpeculativeConfig.disable_batch_size),
# and the draft tree's leaves from DEFAULT_DISABLE_TREE_BATCH_SIZE. n-gram and draft models: see
# SpeculativeConfig. eagle drafts every step (no backoff). Forced on at every batch size, 24
# greedy tokens, each of eight sets of eight held-out chat prompts cycled, best of three (Intel
# Xeon with AMX, 2 cores), chains against no speculation: mean 1.32x at batch 2, 1.20x at 3,
# 1.04x at 4 (median 1.00x), 0.97x at 5 and 0.94x at 6; the default tree took 15% longer than
# chains at batch 2 and 10% at 3 (each leaf is a verified row per sequence), where at batch 1
# it is faster (RESULTS.md's spec_decode run: 1.77x against 1.64x). So eagle is off from 4 busy
# sequences, and its leaves from 2. With 16 requests at once and off only from 16, the 15 left
# after the first finished drafted trees: 0.91x no speculation.
DEFAULT_DISABLE_BATCH_SIZE = 16
EAGLE_DISABLE_BATCH_SIZE = 4
DEFAULT_DISABLE_TREE_BATCH_SIZE = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed.

    ``disable_batch_size``: speculation is switched off for a step when at least this many
    sequences are running or waiting. None: 16, and 4 for eagle (``EAGLE_DISABLE_BATCH_SIZE``).
    Both are measured on a 2-core CPU; a GPU verifies far more tokens per step for free, so set
    it higher there. Verifying k drafts costs (k+1)x the target's tokens; once a step is
    compute-bound those tokens are no longer free. ``benchmarks/spec_decode.py``
    measures the crossover (RESULTS.md): on the 2-core CPU, forced n-gram speculation on
    input-grounded prompts gains ~1.6x at batch 1, breaks even at batch 16 and loses 6-9% from
    32 up (with the C++ CPU kernels; before them, when plain decode was slower, it broke even up
    to 32), while on open chat prompts (~10% acceptance) it loses 15-20% from batch 16 up. Off
    from 16 keeps it where it pays; the per-sequence backoff below limits the loss on open
    prompts at small batches.

    ``max_draft_skip``: after a verification round that accepted nothing, a sequence skips
    drafting for 1, 2, 4, ... steps, at most this many (``engine.spec_decode.backoff``); 0
    drafts every step. None: 16, and 0 for eagle, whose chain stop already drafts little where
    the head is unsure (replaying the first shipped head's held-out chat rounds, a 16-step
    backoff on top of the stop lost 8% of the speed-up: estimated 1.07x instead of 1.17x at
    batch 1).

    ``min_draft_confidence``: a draft model or head stops a sequence's chain once the product
    of its drafts' top-1 probabilities falls below this (EAGLE-2's dynamic draft length: a
    draft past that point is rarely accepted and costs a drafter forward and a verified row);
    the first draft is always made. None: ``DEFAULT_CHAIN_STOP`` for eagle (0.2 for greedy
    and sampled requests), 0 (every chain runs to k) for a draft model. Which drafts
    are made depends on q alone, never on the target's p, so verification stays exact.

    ``draft_leaves`` (eagle): this many more of the head's tokens are verified as leaves beside
    the chain, in the same forward (a draft tree: ``engine.spec_decode.tree``). At every depth
    the chain reaches, the head's next-best tokens there are candidates, each scored by the
    probability of its path: the product of the chain's top-1 probabilities above it, times its
    own (EAGLE-2's ranking: a leaf goes where the head expects the chain to be rejected, most
    often beside an unsure first draft); the best-scored ones are verified. Where the chain is
    rejected at a depth whose leaf holds the token the target emits instead, the leaf's row
    gives one more token. None: ``DEFAULT_DRAFT_LEAVES`` for eagle; 0 verifies chains only.
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
    disable_batch_size: int | None = None
    max_draft_skip: int | None = None
    # A draft model or head samples its drafts from q at temperature > 0 (verified by
    # min(1, p/q)); False drafts the argmax instead (verified as deterministic drafts).
    sample_drafts: bool = True
    min_draft_confidence: float | None = None
    draft_leaves: int | None = None
    disable_tree_batch_size: int = DEFAULT_DISABLE_TREE_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("ngram_min", self.ngram_min)
        if not isinstance(self.ngram_max, int) or self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max must be an integer >= ngram_min, got {self.ngram_max!r}")
        if self.disable_batch_size is not None:
            _positive("disable_batch_size", self.disable_batch_size)
        _positive("disable_tree_batch_size", self.disable_tree_batch_size)
        skip = self.max_draft_skip
        if skip is not None and (not isinstance(skip, int) or isinstance(skip, bool) or skip < 0):
            raise ValueError(f"max_draft_skip must be an integer >= 0, got {skip!r}")
        if not isinstance(self.sample_drafts, bool):
            raise ValueError(f"sample_drafts must be a bool, got {self.sample_drafts!r}")
        c = self.min_draft_confidence
        if c is not None and not (isinstance(c, int | float) and 0.0 <= c <= 1.0):
            raise ValueError(f"min_draft_confidence must be in [0, 1], got {c!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("draft_model is required when method='draft'")
        leaves = self.draft_leaves
        if leaves is not None:
            if not isinstance(leaves, int) or isinstance(leaves, bool) or leaves < 0:
                raise ValueError(f"draft_leaves must be an integer >= 0, got {leaves!r}")
            if leaves and self.method != "eagle":
                raise ValueError(f"draft_leaves needs method='eagle', got {self.method!r}")
            if self.num_speculative_tokens + leaves >= MAX_TREE_TOKENS:
                raise ValueError(
                    f"num_speculative_tokens + draft_leaves must be < {MAX_TREE_TOKENS} "
                    f"(one verified span), got {self.num_speculative_tokens + leaves}"
                )

    @property
    def off_batch_size(self) -> int:
        """``disable_batch_size`` with its per-method default filled in."""
        if self.disable_batch_size is not None:
            return self.disable_batch_size
        return EAGLE_DISABLE_BATCH_SIZE if self.method == "eagle" else DEFAULT_DISABLE_BATCH_SIZE

    @property
    def draft_skip(self) -> int:
        """``max_draft_skip`` with its per-method default filled in."""
        if self.max_draft_skip is not None:
            return self.max_draft_skip
        return 0 if self.method == "eagle" else DEFAULT_MAX_DRAFT_SKIP

    @property
    def chain_stop(self) -> ChainStop:
        """``min_draft_confidence`` with its per-method default filled in."""
        if self.min_draft_confidence is not None:
            c = float(self.min_draft_confidence)
            return ChainStop(c, c)
        return DEFAULT_CHAIN_STOP if self.method == "eagle" else NO_CHAIN_STOP

    @property
    def leaves(self) -> int:
        """``draft_leaves`` with its per-method default filled in."""
        if self.draft_leaves is not None:
            return self.draft_leaves
        return DEFAULT_DRAFT_LEAVES if self.method == "eagle" else 0

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
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
    # Ranks the model is split over (engine.distributed): rank 0 is this process, the others
    # are spawned here, or join from other machines when WORLD_SIZE is set in the environment.
    tensor_parallel_size: int = 1
    # Weight-only quantisation of every Linear (QUANTIZATIONS): "int8" quantises each weight
    # at load to GGUF Q8_0, "q4_1" to Q4_1 but the LM head to Q8_0 (a Q8_0 / Q4_1 GGUF file's
    # tensors keep their shipped values bit for bit: the default model runs its file's numbers).
    quantization: str | None = None
    # KV_CACHE_DTYPES: "auto", the model's dtype, or a 16-bit cache under a float32 model.
    kv_cache_dtype: str = "auto"
    # CUDA: decode steps replay graphs captured at start-up (engine.cuda_graphs) unless True.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        spec = SpeculativeConfig.of(self.speculative_config)
        if spec is not None and self.attention_backend == "xformers" and spec.leaves:
            if spec.draft_leaves is not None:
                raise ValueError(
                    "draft_leaves needs tree masks, which attention_backend 'xformers' lacks "
                    "(triton, cpu and torch have them)"
                )
            spec = replace(spec, draft_leaves=0)  # the default tree: chains instead
        object.__setattr__(self, "speculative_config", spec)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
