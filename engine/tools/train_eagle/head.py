"""The EAGLE head as a trainable module (``fc``, one HF ``LlamaDecoderLayer``, ``lm_head``,
``d2t``, and for ``eagle3`` heads ``fuse``), with an unrolled forward for training-time test.

Step 0 is the head as the engine runs it on target features: at position i the input is
``fc([embed(token_i); feature_{i-1}])`` with causal attention (an eagle3 head's feature is
``fuse`` of the target's stored hidden states). Step s > 0 feeds the head's own
previous output instead: input ``fc([embed(token_i); h^{(s-1)}_{i-1}])``, and position i attends
to what a chain draft would see at inference: step-0 keys at positions <= i - s (computed from
real features) and the step-t key at position i - s + t for t = 1..s. Its output is trained on the
same targets, so the head learns to draft several tokens ahead on its own predictions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pagedspec.engine.spec_decode.eagle_format import feature_layers, llama_config, load_head


class EagleHead(nn.Module):
    def __init__(
        self, layer_config: dict, draft_vocab_size: int, feature_layers: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        cfg = llama_config(layer_config)
        cfg._attn_implementation = "sdpa"
        hidden = cfg.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.fuse = None
        if feature_layers:  # starts as the final hidden state alone (EAGLE-1's feature)
            self.fuse = nn.Linear((len(feature_layers) + 1) * hidden, hidden, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -hidden:] = torch.eye(hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(cfg)  # buffers only, not saved
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        std = cfg.initializer_range
        for module in (self.fc, self.layer.self_attn, self.layer.mlp):
            for p in module.parameters():
                nn.init.normal_(p, 0.0, std)

    @classmethod
    def from_dir(cls, path: str) -> EagleHead:
        """A saved head (``eagle_format.load_head``) in float32, in eval mode: a reference
        implementation to check an inference module against."""
        state_dict, config = load_head(path)
        head = cls(config["layer_config"], config["draft_vocab_size"], feature_layers(config))
        head.load_state_dict({k: v if k == "d2t" else v.float() for k, v in state_dict.items()})
        return head.eval()

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, steps: int = 1, noise: float = 0.0
    ) -> list[torch.Tensor]:
        """embeds [B, L, H], features [B, L, (n + 1) H]: the embedding of token i and the
        target's stored hidden states at i (``feature_layers``' then the final one). Returns
        ``steps`` outputs h^{(s)} [B, L, H]; ``lm_head`` of h^{(s)}_i predicts token i+1."""
        if noise > 0:
            features = features + (torch.rand_like(features) - 0.5) * noise
        return self.unroll(embeds, self.target_features(features), steps)

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's stored hidden states [..., (n + 1) H] -> the head's features [..., H]."""
        return features if self.fuse is None else self.fuse(features)

    def unroll(self, embeds: torch.Tensor, prev: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """``forward`` on the head's features [B, L, H] (``target_features``)."""
        _, length, _ = embeds.shape
        positions = torch.arange(length, device=embeds.device).unsqueeze(0)
        cos, sin = self.rotary(embeds, positions)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for step in range(steps):
            x = self.fc(torch.cat([embeds, shift_right(prev)], dim=-1))
            h = self._layer(x, cos, sin, keys, values, step)
            outs.append(h)
            prev = h
        return outs

    def _layer(self, x, cos, sin, keys, values, step: int) -> torch.Tensor:
        """The decoder layer, written out so that step s can attend to earlier steps' keys."""
        layer, attn = self.layer, self.layer.self_attn
        batch, length, _ = x.shape
        y = layer.input_layernorm(x)
        q = attn.q_proj(y).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(y).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(y).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k)
        values.append(v)
        groups = self.num_heads // self.num_kv_heads
        all_k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
        all_v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
        if step == 0:
            o = F.scaled_dot_product_attention(q, all_k, all_v, is_causal=True, scale=attn.scaling)
        else:
            mask = step_mask(length, step, x.device)
            o = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, scale=attn.scaling)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, length, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, L, H] -> the same with position i holding x_{i-1} and zeros at position 0."""
    return F.pad(x[:, :-1], (0, 0, 1, 0))


def step_mask(length: int, step: int, device=None) -> torch.Tensor:
    """bool [L, (step+1) L], True = attend: query i sees block 0 at j <= i - step and block t
    (1..step) at j == i - step + t."""
    i = torch.arange(length, device=device).unsqueeze(1)
    j = torch.arange(length, device=device).unsqueeze(0)
    blocks = [j <= i - step] + [j == i - step + t for t in range(1, step + 1)]
    return torch.cat(blocks, dim=1)
