"""An EAGLE draft head as the engine runs it: one paged Llama decoder layer over
``fc([embed(token_i); feature_{i-1}])``, a reduced-vocabulary LM head and its draft→target id map;
an ``eagle3`` head also fuses several of the target's layers into its features (``fuse``).

The file format and the head's definition are ``pagedspec.engine.spec_decode.eagle_format``'s; its
KV lives in the same block tables as the target's (one layer), so it rolls back with them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedspec import kernels
from pagedspec.engine.models.attention import AttentionMetadata
from pagedspec.engine.models.layer_stack import LayerStack
from pagedspec.engine.models.layers import RotaryEmbedding
from pagedspec.engine.models.linear import Linear
from pagedspec.engine.models.llama import LlamaDecoderLayer, head_dim_of

# Steps of up to this many tokens run the whole layer on every token in the C++ stack (see
# EagleHead.forward); longer ones (a prompt's feed) only the logit rows, in Python.
SHORT_FEED = 8


class EagleHead(nn.Module):
    def __init__(
        self,
        layer_config,
        draft_vocab_size: int,
        embed_tokens: nn.Embedding,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        hidden = layer_config.hidden_size
        self.config = layer_config
        self.feature_layers = feature_layers  # the target layers ``fuse`` reads besides its last
        n = len(feature_layers)
        self.fuse = Linear((n + 1) * hidden, hidden, bias=False) if n else None
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(layer_config)
        self.lm_head = Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.rotary_emb = RotaryEmbedding(layer_config, head_dim_of(layer_config))
        self.embed_tokens = [embed_tokens]  # the target's, frozen: not a submodule of the head
        # The layer in one C++ call where every token is a logit row (a draft step); None: the
        # Python path always (see forward)
        self.layer_stack: LayerStack | None = LayerStack()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        features: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """features [T, H]: feature_{i-1} for the token at each position i. Returns h
        [len(logit_rows), H], the head's estimate of the target's feature at those rows.

        Every token writes its K/V (all that later positions read of it); only the logit rows,
        each the last token of its span, go on through attention and the MLP. A span that
        mirrors the target's (no drafts this step) thus costs fc and the K/V projection only.
        Where every token is a logit row (each span one token: a draft step), that is the plain
        decoder layer, which the C++ layer stack runs in one call where it applies (the Python
        around ~10 small kernels was ~2/3 of a draft token's time on the CPU). So does a step
        of at most ``SHORT_FEED`` tokens (a round's first, feeding the accepted tokens): the
        stack's extra rows cost less than the Python path's kernels.
        """
        layer, attn = self.layer, self.layer.self_attn
        x = torch.cat([self.embed_tokens[0](input_ids), features.to(self.fc.weight.dtype)], -1)
        x = self.fc(x)
        cos, sin = self.rotary_emb(positions, x.dtype)
        # T logit rows, at most one per span, over T spans: every span is one token
        one_token_spans = len(logit_rows) == x.shape[0] == meta.seq_lens.shape[0]
        if self.layer_stack is not None and (one_token_spans or x.shape[0] <= SHORT_FEED):
            out = self.layer_stack.run([layer], x, cos, sin, kv_caches, meta)
            if out:
                h, residual = out
                return h + residual if one_token_spans else (h + residual)[logit_rows]
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        k_cache, v_cache = kv_caches[0]
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        # the spans that own a logit row (the row is their last token, so searchsorted finds it)
        ends = meta.cu_query_lens[1:].to(torch.int64) - 1
        spans = torch.searchsorted(ends, logit_rows)
        rows = len(logit_rows)
        out = kernels.paged_attention(
            q[logit_rows],
            k_cache,
            v_cache,
            meta.block_tables[spans],
            torch.arange(rows + 1, dtype=torch.int32, device=x.device),
            meta.seq_lens[spans],
            attn.attn.scale,
            backend=meta.backend,
        )
        h = x[logit_rows] + attn.o_proj(out.reshape(rows, attn.q_size))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [N, (n + 1) H] (``feature_layers``' then its final ones,
        ``ModelRunner.forward``'s ``hidden_layers``) -> the features the head reads [N, H]."""
        return hidden if self.fuse is None else self.fuse(hidden.to(self.fuse.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """h [N, H] -> float32 logits over the draft vocabulary [N, draft_vocab_size]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The saved tensors (``eagle_format`` names) into the fused parameters."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        prefix = "layer.self_attn."
        attn.qkv_proj.weight.copy_(
            torch.cat([state_dict[f"{prefix}{p}_proj.weight"] for p in "qkv"])
        )
        attn.o_proj.weight.copy_(state_dict[f"{prefix}o_proj.weight"])
        mlp.gate_up_proj.weight.copy_(
            torch.cat([state_dict[f"layer.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        )
        mlp.down_proj.weight.copy_(state_dict["layer.mlp.down_proj.weight"])
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(self.layer, name).weight.copy_(state_dict[f"layer.{name}.weight"])
        self.fc.weight.copy_(state_dict["fc.weight"])
        if self.fuse is not None:
            self.fuse.weight.copy_(state_dict["fuse.weight"])
        self.lm_head.weight.copy_(state_dict["lm_head.weight"])
        self.d2t.copy_(state_dict["d2t"])
