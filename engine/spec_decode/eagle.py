"""EAGLE drafting: a one-layer head reads the target's own features and drafts from them.

The head's input at position i is (token_i, feature_{i-1}), feature_j being the target's final
hidden state at j (eagle1), or those of some of its layers fused with it (eagle3: the target's
forward returns them, and ``target_features`` fuses a whole step's at once). Before the target's
forward, the head feeds every position from its own KV's end ``valid`` up to C (the target's
computed tokens, whose features earlier forwards produced), then drafts: d1 from h_C, d2 from
(d1, h_C) at C + 1, and so on. Invariants per sequence:

- the head's KV is valid for positions < ``valid`` (computed from the target's features, never
  from the head's own: accepted drafts are fed again); a block is registered for prefix caching
  only once the head's KV in it is valid too;
- ``features`` holds the target's features for positions valid - 1 .. C - 1 (what the next
  step feeds), taken from the steps that computed them; a feature no forward produced (a
  prefix-cache hit's last position, position -1) is zeros.

A sequence that drafts nothing in a step (speculation off under load, backoff, a prompt chunk)
is not fed then unless its backlog valid .. C exceeds ``max_deferred`` positions: its features
pile up and a later step feeds them in one span. A step with speculation off thus costs the
head nothing but a feature copy most of the time.
"""

from __future__ import annotations

import os

import torch

from pagedspec.engine.loader.model_loader import LoadedModel, default_dtype
from pagedspec.engine.models.eagle import EagleHead
from pagedspec.engine.models.linear import Linear
from pagedspec.engine.sample.penalties import TokenHistory
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.spec_decode.chain import chain_drafts, draw_drafts
from pagedspec.engine.spec_decode.draft_state import DraftState
from pagedspec.engine.spec_decode.eagle_format import (
    feature_layers,
    feature_layers_fit,
    layer_model_config,
    load_head,
)
from pagedspec.engine.spec_decode.proposers import Proposal, TargetStep
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.spans import Span
from pagedspec.kernels import cpu_extension
from pagedspec.scheduler import ScheduledSequence

# The head trained here for the default model (``pagedspec train-eagle``).
DEFAULT_HEAD = os.path.join(os.path.dirname(__file__), "heads", "smollm2-135m-eagle")
# Positions a non-drafting sequence may leave unfed: the bound on the features it stores.
MAX_DEFERRED = 32


def load_eagle_head(
    path: str | None, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> EagleHead:
    """The head at ``path`` (None: the default model's), checked against its target."""
    state_dict, config = load_head(path or DEFAULT_HEAD)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    if config["hidden_size"] != hidden or config["target_vocab_size"] != vocab:
        raise ValueError(
            f"draft_model head is for a target with hidden size {config['hidden_size']} and "
            f"{config['target_vocab_size']} tokens; this model has {hidden} and {vocab}"
        )
    layers = feature_layers(config)
    if not feature_layers_fit(layers, target.config.num_hidden_layers):
        raise ValueError(
            f"draft_model head reads the target's layers {list(layers)}; this model has "
            f"{target.config.num_hidden_layers} (a head may read all but the last)"
        )
    layer_config = layer_model_config(config["layer_config"])
    embed = target.model.model.embed_tokens
    with default_dtype(dtype), torch.device(device):
        head = EagleHead(layer_config, config["draft_vocab_size"], embed, layers)
    head.load_weights({k: v.to(device) for k, v in state_dict.items()})
    head.eval().requires_grad_(False)
    # On the CPU in float32 the head runs int8 (Q8_0) weights: a draft token reads 10 MB of
    # weights instead of 36 MB (the shipped head), and verification keeps the output exact
    # whatever the head drafts (on held-out chat its drafts and acceptance came out the same).
    quantize = device.type == "cpu" and dtype == torch.float32 and cpu_extension.available()
    for module in head.modules():
        if isinstance(module, Linear):
            module.quantize() if quantize else module.prepack()
    return head


class EagleProposer:
    runs_every_span = True
    needs_target_hidden = True

    def __init__(
        self,
        runner: ModelRunner,
        seed: int,
        chain_stop: float = 0.0,
        leaves: int = 0,
    ) -> None:
        self.runner = runner
        self.leaves = leaves
        self.head = runner.model
        self.hidden_layers = self.head.feature_layers
        self.chain_stop = chain_stop
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self.max_deferred = MAX_DEFERRED

    def propose(
        self,
        scheduled: list[ScheduledSequence],
        ks: list[int],
        params: list[SamplingParams | None],
        leaf_slots: list[int] | None = None,
    ) -> Proposal:
        """Chains of ``ks[i]`` drafts, with up to min(``self.leaves``, ``leaf_slots[i]``)
        leaves beside them (``chain_drafts``)."""
        spans, features, written, fed = [], [], {}, []
        for i, (s, k) in enumerate(zip(scheduled, ks, strict=True)):
            seq, end = s.seq, s.start  # feed positions valid..C, C = s.start
            state = seq.owner.draft
            if state.valid is None:
                state = None  # nothing fed yet
            start = s.start if state is None else min(state.valid, s.start)
            if not k and state is not None and end + 1 - start <= self.max_deferred:
                continue  # deferred: commit() keeps this step's features
            fed.append(i)
            spans.append(Span(seq.token_ids[start : end + 1], start, 1 if k else 0, s.block_table))
            features.append(self._features(state, start, end + 1))
            written[seq.seq_id] = (end + 1, [])
        drafts: list[list[int]] = [[] for _ in scheduled]
        sampled: list[torch.Tensor | None] = [None] * len(scheduled)
        if not fed:
            return Proposal(drafts, sampled, written)
        h_last: dict[int, torch.Tensor] = {}  # index in fed → h at its last span's end

        def forward(spans: list[Span], owners: list[int]) -> torch.Tensor:
            # first call: the target's features; then each draft's input is the previous h
            feats = torch.stack([h_last[i] for i in owners]) if h_last else first_features
            out = self.runner.forward(spans, features=feats, return_hidden=True)
            logits, hidden = out.logits, out.hidden
            drafting = [i for i, sp in zip(owners, spans, strict=True) if sp.num_logits]
            h_last.update(zip(drafting, hidden, strict=True))  # h at each drafting span's end
            return logits

        first_features = torch.cat(features)
        chains, qs, trees, bits = chain_drafts(
            [scheduled[i] for i in fed], [ks[i] for i in fed], [params[i] for i in fed],
            spans, forward, self._draw, written, self.chain_stop,
            self.leaves, self._alternatives, [(leaf_slots or [0] * len(ks))[i] for i in fed],
            self.target_vocab_size,
        )  # fmt: skip
        for i, chain, q in zip(fed, chains, qs, strict=True):
            drafts[i], sampled[i] = chain, q
        return Proposal(drafts, sampled, written, {fed[j]: tree for j, tree in trees.items()},
                        {fed[j]: rows for j, rows in bits.items()})  # fmt: skip

    def _features(self, state: DraftState | None, start: int, end: int) -> torch.Tensor:
        """feature_{i-1} for positions i in [start, end): stored ones, zeros where unknown."""
        head = self.head
        out = torch.zeros(end - start, head.config.hidden_size, dtype=head.fc.weight.dtype,
                          device=self.runner.device)  # fmt: skip
        if state is not None:  # stored features cover positions first + 1 .. first + n
            lo = max(start, state.first + 1)
            hi = min(end, state.first + 1 + state.features.shape[0])
            if lo < hi:
                out[lo - start : hi - start] = state.features[
                    lo - 1 - state.first : hi - 1 - state.first
                ]
        return out

    def _draw(
        self, logits: torch.Tensor, rows: list[tuple[TokenHistory, int]], grammar_bits: list
    ) -> tuple[list[int], torch.Tensor | None]:
        """Drafts over the draft vocabulary as target ids, with q over the target vocabulary
        (zero outside the draft vocabulary); None when every row is greedy."""
        d2t = self.head.d2t
        ids, q_draft = draw_drafts(
            logits, rows, self.generator, d2t, grammar_bits, self.target_vocab_size
        )
        if q_draft is None:
            return d2t[ids].tolist(), None
        q = q_draft.new_zeros(len(rows), self.target_vocab_size)
        q[:, d2t] = q_draft
        return d2t[ids].tolist(), q

    def _alternatives(
        self, probs: torch.Tensor, count: int, drawn: list[int]
    ) -> list[list[tuple[int, float]]]:
        """Each row's ``count`` likeliest tokens other than its draft (target ids, with their
        probabilities): the leaf candidates of a draft tree."""
        top = probs.topk(min(count + 1, probs.shape[-1]), dim=-1)
        ids, values = self.head.d2t[top.indices].tolist(), top.values.tolist()
        return [
            [(t, p) for t, p in zip(row, ps, strict=True) if t != d][:count]
            for row, ps, d in zip(ids, values, drawn, strict=True)
        ]

    @property
    def target_vocab_size(self) -> int:
        return self.head.embed_tokens[0].num_embeddings

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.target_features(hidden)

    def commit(
        self,
        state: DraftState,
        written: tuple[int, list[int]] | None,
        new_token_ids: list[int],
        target: TargetStep,
    ) -> int | None:
        if written is None:  # deferred: the step's features join the stored ones
            if state.valid is None:
                return None
            assert target.first_position == state.first + state.features.shape[0]
            new = target.hidden[: target.num_computed - target.first_position]
            state.features = torch.cat([state.features, new])
            return state.valid
        # The drafts' KV (computed from the head's own h) is not kept even where accepted:
        # the head was trained on KV from the target's features, so the next step feeds those
        # positions again with the real ones.
        valid = written[0]
        first = target.first_position  # <= valid - 1: the step computed from there
        keep = target.hidden[valid - 1 - first : target.num_computed - first]
        state.valid, state.first, state.features = valid, valid - 1, keep.clone()
        return valid

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)
