"""Draft trees (pagedspec.engine.spec_decode.tree): shapes, slots, the config, leaf drafting and the
manager's slot split. Their verification and KV are tested end to end in test_eagle (greedy
output, logprobs, the head's features after a leaf) and test_spec_distribution (the law)."""

from types import SimpleNamespace

import pytest
import torch

from pagedspec.engine.config import EngineConfig, SpeculativeConfig
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.spec_decode.chain import chain_drafts
from pagedspec.engine.spec_decode.draft_state import DraftState
from pagedspec.engine.spec_decode.proposers import Proposal
from pagedspec.engine.spec_decode.speculation import Speculation
from pagedspec.engine.spec_decode.tree import DraftTree, tree_slots
from pagedspec.engine.worker.spans import Span


def test_a_tree_is_its_chain_then_leaves_off_the_chain():
    tree = DraftTree(chain=3, leaf_depths=(1, 1, 2))
    assert tree.parents == (-1, 0, 1, 2, 0, 0, 1)  # span: last token, d1..d3, then leaves
    drafts = [10, 11, 12, 20, 21, 22]
    assert tree.leaf_hit(drafts, [21]) == 5  # d1 rejected; the target's token is leaf 21
    assert tree.leaf_hit(drafts, [10, 22]) == 6  # d1 accepted, d2 rejected for leaf 22
    assert tree.leaf_hit(drafts, [10, 21]) is None  # 21 is a depth-1 leaf, not depth 2
    assert tree.leaf_hit(drafts, [99]) is None
    assert tree.leaf_hit(drafts, [10, 11, 12, 20]) is None  # all accepted: a bonus, no leaf
    assert tree_slots(3, 2) == 5 and tree_slots(1, 2) == 3 and tree_slots(2, 0) == 2
    assert tree_slots(0, 2) == 0  # no chain, no leaves


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(method="eagle", draft_leaves=-1), "draft_leaves must be an integer >= 0"),
        (dict(method="eagle", draft_leaves=True), "draft_leaves must be an integer >= 0"),
        (dict(method="eagle", draft_leaves=(2,)), "draft_leaves must be an integer >= 0"),
        (dict(method="ngram", draft_leaves=1), "draft_leaves needs method='eagle'"),
        (dict(method="eagle", num_speculative_tokens=4, draft_leaves=60), "must be < 64"),
    ],
)
def test_bad_draft_leaves_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**fields)


def test_draft_leaves_defaults():
    assert SpeculativeConfig(method="eagle").draft_leaves == 3
    assert SpeculativeConfig(method="eagle", draft_leaves=None).draft_leaves == 3
    assert SpeculativeConfig(method="eagle", draft_leaves=5).draft_leaves == 5
    assert SpeculativeConfig(method="ngram").draft_leaves == 0
    assert SpeculativeConfig(method="ngram", draft_leaves=0).draft_leaves == 0
    # the span limit holds for the default leaves too, and chains alone are not trees
    with pytest.raises(ValueError, match="must be < 64"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=61)
    assert SpeculativeConfig(method="eagle", num_speculative_tokens=64, draft_leaves=0)


def test_xformers_has_no_tree_masks_so_eagle_verifies_chains_there():
    """Under xformers, eagle's draft_leaves left unset (or None) in a dict is 0; set above 0 it
    is refused, and so is a SpeculativeConfig built with leaves (its default already filled)."""
    for unset in ({"method": "eagle"}, {"method": "eagle", "draft_leaves": None}):
        chains = EngineConfig(attention_backend="xformers", speculative_config=unset)
        assert chains.speculative_config.draft_leaves == 0
    explicit = ({"method": "eagle", "draft_leaves": 2}, SpeculativeConfig(method="eagle"))
    for spec in explicit:
        with pytest.raises(ValueError, match="draft_leaves needs tree masks.*'xformers'"):
            EngineConfig(attention_backend="xformers", speculative_config=spec)
    chains = SpeculativeConfig(method="eagle", draft_leaves=0)
    assert EngineConfig(attention_backend="xformers", speculative_config=chains)
    assert EngineConfig(speculative_config={"method": "eagle"}).speculative_config.draft_leaves


def _scheduled(n: int) -> list:
    owner = SimpleNamespace(grammar=None)  # unconstrained
    seqs = [SimpleNamespace(seq_id=i, token_ids=[1, 2, 3], num_prompt_tokens=2, owner=owner)
            for i in range(n)]  # fmt: skip
    return [SimpleNamespace(seq=s, start=2, block_table=[0]) for s in seqs]


# A drafter whose distribution depends on the depth only (tokens 0..4): the chain drafts 0s;
# depth 1 is unsure, depth 2 sure, depth 3 split between tokens 0 and 1.
DEPTH_PROBS = [[0.5, 0.3, 0.1, 0.06, 0.04], [0.9, 0.04, 0.03, 0.02, 0.01],
               [0.4, 0.35, 0.15, 0.06, 0.04]]  # fmt: skip


def _draft_by_depth(scheduled, ks, leaves, leaf_slots):
    calls = []

    def forward(spans, owners):
        calls.append(owners)
        return torch.tensor(DEPTH_PROBS[len(calls) - 1]).log().expand(len(spans), 5).clone()

    def draw(rows_logits, rows, grammars):
        return rows_logits.argmax(-1).tolist(), None

    def alternatives(probs, count, drawn):
        top = probs.topk(count + 1, dim=-1)
        return [[(t, p) for t, p in zip(ids, ps, strict=True) if t != d][:count]
                for ids, ps, d in zip(top.indices.tolist(), top.values.tolist(), drawn,
                                      strict=True)]  # fmt: skip

    spans = [Span([3], 2, 1, [0]) for _ in scheduled]
    written = {s.seq.seq_id: (3, []) for s in scheduled}
    params = [SamplingParams(temperature=0)] * len(scheduled)
    return chain_drafts(scheduled, ks, params, spans, forward, draw, written, leaves=leaves,
                        alternatives=alternatives, leaf_slots=leaf_slots)  # fmt: skip


def test_leaves_go_where_their_paths_are_likeliest_within_each_sequences_slots():
    """Scores: depth 1's token 1: 0.3, token 2: 0.1; depth 2's: 0.5 * 0.04 = 0.02; depth 3's
    token 1: 0.5 * 0.9 * 0.35 = 0.1575. Two leaves: depth 1's token 1 and depth 3's token 1,
    not depth 1's second choice. Each sequence takes at most its leaf slots, and only depths its
    chain reaches."""
    drafts, _, trees, _ = _draft_by_depth(_scheduled(4), [3, 3, 1, 3], 2, [2, 1, 2, 0])
    assert drafts == [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 2], [0, 0, 0]]
    assert trees == {0: DraftTree(3, (1, 3)), 1: DraftTree(3, (1,)), 2: DraftTree(1, (1, 1))}
    drafts, _, trees, _ = _draft_by_depth(_scheduled(1), [3], 4, [4])
    assert drafts == [[0, 0, 0, 1, 2, 1, 2]]  # then depth 3's token 2 (0.0675) over depth 1's 3
    assert trees == {0: DraftTree(3, (1, 1, 3, 3))}


def speculation(config: SpeculativeConfig, proposer=None) -> Speculation:
    proposer = proposer or SimpleNamespace(runs_every_span=False)
    proposer.needs_target_hidden = False
    return Speculation(config, proposer, None, None, max_model_len=100)


PARAMS = SamplingParams(temperature=0, max_tokens=50)


def test_the_round_reserves_tree_slots_and_gives_cut_slots_to_the_chain_first():
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=3, draft_leaves=6)
    seen = {}

    class Proposer:
        runs_every_span = False

        def propose(self, scheduled, ks, params, leaf_slots):
            seen.update(ks=ks, leaf_slots=leaf_slots)
            return Proposal([[] for _ in ks], [None] * len(ks), {})

    spec = speculation(config, Proposer())
    lookahead = spec.lookahead(1)
    assert lookahead(_Seq(1, 10)) == 3 + 4 + 2
    assert lookahead(_Seq(49, 60)) == 0  # one token left: no drafts
    assert lookahead(_Seq(47, 60)) == 2 + 4 + 2  # two drafts at most: the chain is cut
    # a full tree; one the scheduler cut to 5 slots; one capped at two drafts
    full = [_Scheduled(_Seq(1, 10), 9), _Scheduled(_Seq(1, 10), 5), _Scheduled(_Seq(47, 60), 8)]
    spec._propose(full)
    assert seen == {"ks": [3, 3, 2], "leaf_slots": [6, 2, 6]}


def test_leaves_only_at_batch_one_and_eagle_off_from_its_own_batch_size():
    """From disable_tree_batch_size busy sequences a step verifies chains alone, and eagle's
    speculation is off from its own disable_batch_size (n-gram's stays on to 16)."""
    config = SpeculativeConfig(method="eagle")
    seq, k, tree, leaves = _Seq(1, 10), 4, config.disable_tree_batch_size, config.draft_leaves
    eagle = speculation(config)
    assert eagle.lookahead(1)(seq) == k + leaves
    assert eagle.lookahead(tree - 1)(seq) == k + leaves
    assert eagle.lookahead(tree)(seq) == k
    assert eagle.lookahead(config.disable_batch_size - 1)(seq) == k
    assert eagle.lookahead(config.disable_batch_size) == 0
    wide = speculation(
        SpeculativeConfig(method="eagle", disable_batch_size=64, disable_tree_batch_size=9)
    )
    assert wide.lookahead(8)(seq) == k + leaves
    assert wide.lookahead(63)(seq) == k
    ngram = speculation(SpeculativeConfig())
    assert ngram.lookahead(15)(seq) == k
    assert ngram.lookahead(16) == 0


class _Seq:
    def __init__(self, outputs: int, length: int, seq_id: int = 0) -> None:
        self.seq_id, self.num_output_tokens, self.length = seq_id, outputs, length
        self.owner = SimpleNamespace(
            request=SimpleNamespace(params=PARAMS), draft=DraftState(), grammar=None
        )

    def __len__(self) -> int:
        return self.length


class _Scheduled:
    def __init__(self, seq: _Seq, slots: int) -> None:
        self.seq, self.num_lookahead_slots, self.samples = seq, slots, True
