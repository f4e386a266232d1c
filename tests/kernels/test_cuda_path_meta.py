"""The CUDA code path without a GPU: the model forward (with the KV write and paged attention),
block copies and sampling run on the ``meta`` device at the Llama-3.2-1B and Llama-3.1-8B shapes
(no memory is allocated, no arithmetic done). On meta the layers take their non-CPU branches, as
on CUDA; the Triton launches are replaced by stubs that check every tensor argument's device,
dtype, shape and 16-byte alignment (Triton specialises on alignment). A tensor created on the
wrong device fails, and so does any host read of device data (meta tensors have none).
"""

import functools
import inspect

import pytest
import torch
from conftest import ROOT
from transformers import AutoConfig

from pagedspec.engine.loader.model_loader import default_dtype, model_kv_shape
from pagedspec.engine.models import get_model_class
from pagedspec.engine.sample.draws import sample_from_probs
from pagedspec.engine.sample.sampler import SamplingBatch, processed_probs
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.spans import Span
from pagedspec.kernels import triton_attention, triton_kv_write
from pagedspec.memory import allocate_kv_caches

META = torch.device("meta")
CONFIGS = ROOT / "benchmarks" / "model_configs"
BLOCK_SIZE, NUM_BLOCKS = 16, 64


class StubKernel:
    """Stands in for a Triton kernel: ``stub[grid](*args, **constexprs)`` checks each tensor
    argument against ``expect[name] = (dtype, shape)`` (every tensor must have an entry)."""

    def __init__(self, kernel) -> None:
        self.arg_names = list(inspect.signature(kernel.fn).parameters)
        self.expect: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **constexprs) -> None:
        assert all(isinstance(g, int) and g > 0 for g in grid), grid
        for name, arg in zip(self.arg_names, args, strict=False):
            if not isinstance(arg, torch.Tensor):
                assert isinstance(arg, int | float), (name, type(arg))
                continue
            assert arg.device == META, f"{name} is on {arg.device}"
            assert arg.storage_offset() * arg.element_size() % 16 == 0, f"{name} is unaligned"
            dtype, shape = self.expect[name]
            assert (arg.dtype, tuple(arg.shape)) == (dtype, shape), (name, arg.dtype, arg.shape)
        self.launches.append(constexprs)


@pytest.fixture
def stubs(monkeypatch):
    """The three Triton kernels stubbed; the launch code believes it runs on a 132-SM GPU."""
    kernels = {
        "attention": (triton_attention, "_attention_kernel"),
        "merge": (triton_attention, "_merge_kernel"),
        "write": (triton_kv_write, "_write_kv_kernel"),
    }
    out = {}
    for key, (module, name) in kernels.items():
        out[key] = StubKernel(getattr(module, name))
        monkeypatch.setattr(module, name, out[key])
    for module in (triton_attention, triton_kv_write):
        monkeypatch.setattr(module, "check_device", lambda kernel, device: None)
    monkeypatch.setattr(triton_attention, "interpreted", lambda kernel: False)
    splits = triton_attention.splits_for
    monkeypatch.setattr(triton_attention, "_auto_num_splits", lambda p, c, d: splits(p, c, 132))
    return out


def _expect(stubs, model_config, dtype, spans: list[Span], width: int) -> None:
    _, kv_heads, head_dim = model_kv_shape(model_config)
    heads = model_config.num_attention_heads
    tokens, seqs = sum(len(s.token_ids) for s in spans), len(spans)
    cache = (dtype, (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim))
    q = (dtype, (tokens, heads, head_dim))
    stubs["write"].expect = {
        "key_ptr": (dtype, (tokens, kv_heads, head_dim)),
        "value_ptr": (dtype, (tokens, kv_heads, head_dim)),
        "k_cache_ptr": cache,
        "v_cache_ptr": cache,
        "slot_ptr": (torch.int64, (tokens,)),
    }
    # Split-KV partials: [splits, T, Hq] and [splits, T, Hq, BLOCK_D]; unsplit they alias out.
    plan = triton_attention.plan_launch(
        tokens, seqs, heads // kv_heads, kv_heads, width * BLOCK_SIZE, META
    )
    splits = plan.num_splits
    part = (torch.float32, (splits, tokens, heads)) if splits > 1 else q
    acc = (torch.float32, (splits, tokens, heads, head_dim)) if splits > 1 else q
    stubs["attention"].expect = {
        "q_ptr": q, "k_ptr": cache, "v_ptr": cache, "out_ptr": q,
        "part_m_ptr": part, "part_l_ptr": part, "part_acc_ptr": acc,
        "block_tables_ptr": (torch.int32, (seqs, width)),
        "cu_query_lens_ptr": (torch.int32, (seqs + 1,)),
        "seq_lens_ptr": (torch.int32, (seqs,)),
        "tree_mask_ptr": (torch.int32, (seqs,)),  # no tree: seq_lens stands in, unread
    }  # fmt: skip
    stubs["merge"].expect = {
        "out_ptr": q, "part_m_ptr": part, "part_l_ptr": part, "part_acc_ptr": acc,
    }  # fmt: skip


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3.1-8b"])
def test_cuda_path_on_meta(stubs, shape):
    dtype = torch.bfloat16
    # As load_model builds it, minus the weights' values (meta has no random generator).
    config = AutoConfig.from_pretrained(CONFIGS / f"{shape}.json")
    with default_dtype(dtype), META:
        model = get_model_class(config)(config).eval()
    model.to(META)  # buffers computed on the CPU (rope's), moved as load_model moves them
    layers, kv_heads, head_dim = model_kv_shape(config)
    caches = allocate_kv_caches(layers, kv_heads, head_dim, NUM_BLOCKS, BLOCK_SIZE, dtype, META)
    runner = ModelRunner(model, caches, "triton", META)
    # A decode with a long table (split-KV on a 132-SM GPU), a prefill chunk, a verification span
    # (1 + 4 drafts: 5 logit rows), then one decode alone.
    steps = [
        [Span([5], 40 * BLOCK_SIZE, 1, list(range(41)))],
        [Span(list(range(3, 40)), 0, 1, [1, 2, 3]), Span([7], 20, 1, [4, 5]),
         Span([1, 2, 3, 4, 5], 33, 5, [6, 7, 8])],
        [Span([9], 3, 1, [9])],
    ]  # fmt: skip
    for spans in steps:
        width = max(len(s.block_table) for s in spans)
        _expect(stubs, config, dtype, spans, width)
        before = {k: len(s.launches) for k, s in stubs.items()}
        logits = runner.forward(spans).logits
        rows = sum(s.num_logits for s in spans)
        assert logits.device == META and logits.shape == (rows, config.vocab_size)
        assert logits.dtype == torch.float32
        assert len(stubs["write"].launches) - before["write"] == layers
        assert len(stubs["attention"].launches) - before["attention"] == layers
        batch = SamplingBatch.from_params(
            [0.0] + [0.8] * (rows - 1), [0] * rows, [0.9] * rows, [0.0] * rows, device=META
        )
        # The Sampler's draw, with the shared generator left out (meta has none).
        tokens = sample_from_probs(processed_probs(logits, batch), batch.generators, None)
        assert tokens.device == META and tokens.shape == (rows,)
    assert len(stubs["merge"].launches) == layers  # the long decode alone was split
    runner.copy_blocks([(1, 2), (3, 4)])
