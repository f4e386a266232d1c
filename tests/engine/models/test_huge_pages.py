"""pagedspec.engine.models.huge_pages: the loader makes the packs in one MADV_HUGEPAGE mapping, back
to back from a 2 MB boundary, with no float weight stranded in it, and the same bits as without
it. Huge pages are forced "available": where THP is off the kernel ignores the advice, and
where the packs go is what is under test."""

import copy
import mmap
from collections import defaultdict

import pytest
import torch
from test_layer_stack import PRECISIONS, assert_same_bits, load
from test_models import COMMON, SCHEDULE, run_schedule, save_tiny
from transformers import LlamaConfig

from pagedspec.engine.models import huge_pages
from pagedspec.engine.models.linear import packed_weight
from pagedspec.engine.models.quant import quantized_weight
from pagedspec.kernels import cpu_extension

pytestmark = [
    pytest.mark.skipif(
        not cpu_extension.available(), reason="the C++ CPU kernels cannot be built here"
    ),
    pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here"),
]

CONFIGS = {
    "tied": dict(tie_word_embeddings=True, attention_bias=True),
    # an LM head of 260 rows, no multiple of 16: a float32 or bf16 pack of it is new memory,
    # so its float weight must not be made in the arena
    "odd-vocab": dict(vocab_size=260),
}


def packs_by_storage(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    """Every pack of the model's weights (a tied one once), grouped by the memory it lies in."""
    groups = defaultdict(list)
    for w in {id(p): p for p in model.parameters()}.values():
        pack, quant = packed_weight(w), quantized_weight(w)
        for t in [pack] if pack is not None else [quant.q, quant.scales] if quant else []:
            groups[t.untyped_storage().data_ptr()].append(t)
    return groups


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def load_with(tmp_path, precision: str, monkeypatch, thp: bool) -> torch.nn.Module:
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: thp)
    return load(tmp_path, precision)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_packs_made_back_to_back_on_huge_pages_give_the_same_bits(
    precision, config, tmp_path, monkeypatch
):
    save_tiny(LlamaConfig(**COMMON | CONFIGS[config]), tmp_path)
    model = load_with(tmp_path, precision, monkeypatch, thp=True)
    groups = packs_by_storage(model)
    arena = sorted(groups.pop(max(groups, key=lambda k: len(groups[k]))), key=torch.Tensor.data_ptr)
    outside = [t for ts in groups.values() for t in ts]
    odd_float_head = config == "odd-vocab" and precision in ("fp32", "bf16")
    assert len(outside) == (1 if odd_float_head else 0)
    assert arena[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for a, b in zip(arena, arena[1:], strict=False):
        assert b.data_ptr() == a.data_ptr() + huge_pages.aligned(nbytes(a))
    if precision in ("fp32", "bf16"):  # the arena holds exactly the float weights packed there
        mapped = arena[0].untyped_storage().nbytes() - huge_pages.HUGE_PAGE
        assert mapped == sum(huge_pages.aligned(nbytes(t)) for t in arena)

    plain = load_with(tmp_path, precision, monkeypatch, thp=False)
    assert all(len(group) == 1 for group in packs_by_storage(plain).values())
    assert_same_bits(
        run_schedule(model, SCHEDULE, backend="cpu"), run_schedule(plain, SCHEDULE, backend="cpu")
    )


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_copied_linear_copies_its_own_pack_not_the_arena(precision, tmp_path, monkeypatch):
    save_tiny(LlamaConfig(**COMMON), tmp_path)
    model = load_with(tmp_path, precision, monkeypatch, thp=True)
    layer = copy.deepcopy(model.model.layers[0].mlp.down_proj)
    pack, quant = packed_weight(layer.weight), quantized_weight(layer.weight)
    for t in [pack] if pack is not None else [quant.q, quant.scales]:
        assert t.untyped_storage().nbytes() == nbytes(t)


def test_a_refused_mapping_leaves_ordinary_memory(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = huge_pages.WeightArena(1 << 20).empty((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.untyped_storage().nbytes() == 128
