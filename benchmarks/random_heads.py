"""A randomly initialised EAGLE head for a target model: the tests' and the host-overhead
benchmark's stand-in for a trained one."""

import torch
from transformers import AutoConfig

from pagedspec.engine.spec_decode.eagle_format import (
    expected_shapes,
    layer_config_from_hf,
    make_config,
    save_head,
)


def build_random_eagle_head(
    path, target: str, draft_vocab_size: int, seed: int = 0, feature_layers: tuple[int, ...] = ()
) -> str:
    """A randomly initialised EAGLE head for the HF model at ``target`` (a directory or its
    config.json; eagle3 with ``feature_layers``): its draft vocabulary is the target ids 0, 2, 4,
    ... then the rest, ``draft_vocab_size`` of them (a real subset, so drafts outside it never
    occur), weights at a scale that gives peaked but varied drafts."""
    hf = AutoConfig.from_pretrained(target)
    config = make_config(
        layer_config_from_hf(hf), draft_vocab_size, hf.vocab_size, target, feature_layers
    )
    gen = torch.Generator().manual_seed(seed)
    state = {
        name: torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 0.05)
        + (1.0 if name.endswith("layernorm.weight") else 0.0)
        for name, shape in expected_shapes(config).items()
        if name != "d2t"
    }
    ids = list(range(0, hf.vocab_size, 2)) + list(range(1, hf.vocab_size, 2))
    state["d2t"] = torch.tensor(sorted(ids[:draft_vocab_size]), dtype=torch.int64)
    save_head(str(path), state, config)
    return str(path)
