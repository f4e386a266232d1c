"""Llama-family causal LM (llama, mistral, qwen2, qwen3) over one packed batch of tokens.

All sequences of a step are concatenated into T tokens; attention separates them through the
paged KV cache and ``AttentionMetadata``. q/k/v and gate/up are fused into single projections;
``load_weights`` maps HF checkpoint names onto them. Under tensor parallelism (a ``TPShard`` of
size > 1) each rank builds the model with its share of the heads, MLP columns and vocabulary
(``pagedspec.engine.distributed``) and ``load_weights`` slices the checkpoint accordingly; with size
1 the layers are exactly the single-device ones.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedspec.engine.distributed.shard import NO_TP, TPShard, kv_heads_of, shard_weight
from pagedspec.engine.models.attention import AttentionMetadata, PagedAttention
from pagedspec.engine.models.layer_stack import LayerStack
from pagedspec.engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, swiglu
from pagedspec.engine.models.linear import Embedding, Linear
from pagedspec.engine.models.parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)

# (fused parameter, HF parameter, shard index): HF weights stacked into one fused matrix.
STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def head_dim_of(config: PretrainedConfig) -> int:
    """config.head_dim when set (qwen3, mistral-nemo), else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window if any layer uses one (mistral; qwen2/3 with use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types and "sliding_attention" not in layer_types):
        return None
    return int(window)


def _row_linear(shard: TPShard, in_features: int, out_features: int, bias: bool) -> Linear:
    """o_proj / down_proj: a plain Linear on one device, all-reduced across ranks under TP."""
    if shard.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, shard)


def _owns_whole(tensor: torch.Tensor, param: nn.Parameter) -> bool:
    """Whether ``tensor`` can become ``param``'s data as it is: same shape, dtype and device,
    contiguous, and the only tensor on its storage (no larger buffer kept alive by a view)."""
    return (
        tensor.shape == param.shape
        and tensor.dtype == param.dtype
        and tensor.device == param.device
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, shard: TPShard = NO_TP) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // shard.size
        self.num_kv_heads = kv_heads_of(shard, config.num_key_value_heads)[1]
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # qwen2 always has q/k/v biases and no o_proj bias; the others follow attention_bias.
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or config.model_type == "qwen2"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = _row_linear(shard, self.q_size, config.hidden_size, bias)
        # qwen3 normalises each head of q and k before rope.
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], q and k normed and rotated."""
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # One rope call rotates the query and key heads together.
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, shard: TPShard = NO_TP) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {config.hidden_act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size // shard.size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=bias)
        self.down_proj = _row_linear(shard, inter, config.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, shard: TPShard = NO_TP) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, shard)
        self.mlp = LlamaMLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream it is to be added to).

        The hidden state is ``h + residual`` (just ``h`` for the first layer, residual None):
        each residual add is left to the RMSNorm after it, which fuses the two (vLLM's layout;
        one C++ call instead of an add and a norm, in place)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, shard: TPShard = NO_TP) -> None:
        super().__init__()
        if shard.size == 1:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, shard) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        # The layers in one C++ call where it computes the same bits (CPU, one device; see
        # pagedspec.engine.models.layer_stack); None runs the Python loop always.
        self.layer_stack: LayerStack | None = LayerStack() if shard.size == 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; with ``capture`` (ascending layer
        indices), [T, (len(capture) + 1) * hidden]: the hidden state after each of those layers
        (the residual stream, before any norm), then the final one."""
        if capture and (list(capture) != sorted(set(capture)) or capture[0] < 0
                        or capture[-1] >= len(self.layers)):  # fmt: skip
            raise ValueError(
                f"capture must be ascending indices below {len(self.layers)}, got {capture}"
            )
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        stack = self.layer_stack
        out = (
            None if stack is None else stack.run(self.layers, h, cos, sin, kv_caches, meta, capture)
        )
        if out:
            h, residual, *captured = out
        else:
            residual, captured = None, []
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                h, residual = layer(h, residual, cos, sin, kv_cache, meta)
                if i in capture:
                    captured.append(h + residual)
        final = self.norm(h) if residual is None else self.norm(h, residual)[0]
        return torch.cat([*captured, final], dim=-1) if captured else final


class LlamaForCausalLM(nn.Module):
    """The model the ModelRunner drives: ``forward`` -> hidden states, ``compute_logits`` -> logits.

    Contexts must stay within ``max_model_len``: sliding-window attention is not implemented, so
    a model with a window only supports contexts that fit inside it (where it changes nothing).
    """

    def __init__(self, config: PretrainedConfig, shard: TPShard = NO_TP) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.model = LlamaModel(config, shard)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        vocab_rows = shard.padded_vocab(config.vocab_size) // shard.size
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        window = sliding_window_of(config)
        max_len = config.max_position_embeddings
        self.max_model_len = max_len if window is None else min(max_len, window)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> hidden states [T, hidden] after the final norm
        (with ``capture``, those of some layers before them: ``LlamaModel.forward``)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, capture)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> float32 logits [N, vocab] (under tensor parallelism: on rank 0;
        the other ranks return None)."""
        logits = self.lm_head(hidden).float()
        if self.shard.size == 1:
            return logits
        return gather_logits(logits, self.config.vocab_size, self.shard)

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[nn.Parameter], None] | None = None,
    ) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be covered.

        Under tensor parallelism each weight is first cut to this rank's slice; ``weights`` may
        then yield lazy safetensors slices, so a rank reads only its part. Raises ValueError
        for an unknown name, a shape mismatch or a missing weight. ``on_loaded(parameter)``
        runs as soon as a parameter has all its parts (quantising at load uses it, so that
        the float32 model is never resident whole). With ``on_loaded``, a parameter that one
        checkpoint tensor fills whole, in its dtype and with a storage of its own, takes that
        tensor as its data instead of a copy: the hook consumes it at once, and a copy would
        hold the weight twice (the read buffer beside the parameter's pages) at the peak.
        """
        params = dict(self.named_parameters())  # a tied lm_head.weight appears once, as embed
        loaded: dict[str, set[int]] = {name: set() for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints store rope frequencies; we compute our own
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name, shard = self._param_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no place in the model")
            sizes = self._shard_sizes(name)
            target = params[name].narrow(0, sum(sizes[:shard]), sizes[shard])
            if self.shard.size > 1:
                tensor = shard_weight(
                    hf_name, tensor, self.config, self.shard, head_dim_of(self.config)
                )
                if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    target[tensor.shape[0] :].zero_()  # vocabulary padding rows
                    target = target[: tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            param = params[name]
            # not under tensor parallelism: a lazy slice there may be the file's own mapped pages
            if on_loaded is not None and self.shard.size == 1 and _owns_whole(tensor, param):
                param.data = tensor
            else:
                target.copy_(tensor)
            loaded[name].add(shard)
            if on_loaded is not None and len(loaded[name]) == len(self._shard_sizes(name)):
                on_loaded(param)
            del tensor, target  # a consumed read buffer goes before the next tensor is read
        missing = [n for n in params if len(loaded[n]) != len(self._shard_sizes(n))]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing}")

    @staticmethod
    def _param_name(hf_name: str) -> tuple[str, int]:
        for fused, part, shard in STACKED:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), shard
        return hf_name, 0

    def _shard_sizes(self, name: str) -> list[int]:
        """Row counts of the HF weights stacked into parameter ``name`` (one entry if unfused)."""
        if ".qkv_proj." in name:
            attn = self.model.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if ".gate_up_proj." in name:
            return [self.config.intermediate_size // self.shard.size] * 2
        return [self.get_parameter(name).shape[0]]
