"""Presence, frequency and repetition penalties: the vectorised step against the formulas, one
token at a time in float64; greedy engine output against a hand-rolled HF loop, with and
without speculation (drafts in a verification span count as generated for the rows after them).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedspec import LLM, SamplingParams
from pagedspec.engine.sample.penalties import TokenHistory, apply_penalties


def naive_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """One row, float64, straight from vLLM's / OpenAI's definitions (the oracle)."""
    out = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            r = params.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        count = output.count(token)
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out.append(logit)
    return out


def random_histories(rng: random.Random, vocab: int, num_spans: int) -> list[TokenHistory]:
    histories = []
    for i in range(num_spans):
        params = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, -0.7, 2.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.6, 2.5]),
        )
        if i % 4 == 3:
            params = SamplingParams()  # a request without penalties in the same batch
        prompt_len, out_len, num_drafts = rng.randint(1, 12), rng.randint(0, 15), rng.randint(0, 4)
        tokens = [rng.randrange(vocab) for _ in range(prompt_len + out_len)]
        drafts = [rng.randrange(vocab) for _ in range(num_drafts)]
        num_rows = rng.randint(1, num_drafts + 1)
        histories.append(TokenHistory(params, tokens, prompt_len, drafts, num_rows))
    return histories


def naive_rows(logits: torch.Tensor, histories: list[TokenHistory]) -> torch.Tensor:
    rows, r = [], 0
    for h in histories:
        prompt = list(h.token_ids[: h.num_prompt_tokens])
        output = list(h.token_ids[h.num_prompt_tokens :])
        skipped = len(h.drafts) - h.num_rows + 1  # the span's first row follows these drafts
        for j in range(h.num_rows):
            seen = output + list(h.drafts[: skipped + j])
            rows.append(naive_penalties(logits[r].double().tolist(), prompt, seen, h.params))
            r += 1
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
def test_penalised_logits_equal_the_formulas_token_by_token(seed):
    rng = random.Random(seed)
    vocab = 40
    histories = random_histories(rng, vocab, 12)
    num_rows = sum(h.num_rows for h in histories)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    raw = logits.clone()
    out = apply_penalties(logits, histories)
    torch.testing.assert_close(out.double(), naive_rows(raw, histories), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, raw)  # the input (the model's logit rows) is left as it was
    assert any(h.params.has_penalties for h in histories)
    assert any(not h.params.has_penalties for h in histories)  # mixed batch: rows picked out


def test_penalties_over_a_reduced_vocabulary_follow_its_token_map():
    """A drafter's columns are target ids ``token_map[c]``; history ids outside it are ignored."""
    rng = random.Random(7)
    target_vocab, token_map = 30, torch.tensor([0, 3, 4, 9, 17, 22, 29])
    histories = random_histories(rng, target_vocab, 6)
    # a row whose every token lies outside the map: nothing to penalise
    histories.append(TokenHistory(SamplingParams(presence_penalty=1.0), [1, 2, 5], 2))
    num_rows = sum(h.num_rows for h in histories)
    full = torch.randn(num_rows, target_vocab, generator=torch.Generator().manual_seed(1)) * 3
    out = apply_penalties(full[:, token_map], histories, token_map)
    expected = naive_rows(full, histories)[:, token_map]
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)


def test_no_penalties_is_no_work():
    logits = torch.randn(3, 10)
    off = TokenHistory(SamplingParams(), [1, 2, 3], 2, [4, 5], 3)
    assert apply_penalties(logits, [off]) is logits


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(presence_penalty=-2.01),
        dict(presence_penalty=float("nan")),
        dict(frequency_penalty=3),
        dict(frequency_penalty=-2.5),
        dict(frequency_penalty="high"),
        dict(repetition_penalty=0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=float("inf")),
        dict(repetition_penalty=True),
    ],
)
def test_out_of_range_penalties_raise_naming_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=rf"{field} must be .*(\[-2, 2\]|> 0)"):
        SamplingParams(**bad)


# --- the engine against a hand-rolled HF loop ----------------------------------------------------

PENALISED = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.8),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        presence_penalty=-0.5,
        frequency_penalty=0.4,
        repetition_penalty=0.8,
    ),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # no penalty, same batch
]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "one two three four five six seven eight nine ten one two three",
    "def add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties applied by ``naive_penalties`` to HF's logits."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
        row = naive_penalties(logits.double().tolist(), prompt, output, params)
        output.append(max(range(len(row)), key=lambda t: (row[t], -t)))
    return output


@pytest.fixture(scope="module")
def hf_outputs(tiny_llama) -> list[list[int]]:
    llm = LLM(tiny_llama, num_kv_blocks=128)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    model = LlamaForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    return [hf_greedy(model, p, params) for p, params in zip(prompts, PENALISED, strict=True)]


def test_penalised_greedy_equals_a_hand_rolled_hf_loop(tiny_llama, hf_outputs):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    outs = llm.generate(PROMPTS, PENALISED, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs
    # the premise: the penalties change the output
    plain = llm.generate(PROMPTS, PENALISED[-1], use_tqdm=False)
    assert all(
        o.outputs[0].token_ids != p.outputs[0].token_ids
        for o, p in zip(outs[:-1], plain[:-1], strict=True)
    )


def test_penalised_greedy_with_ngram_speculation_equals_plain(tiny_llama, hf_outputs):
    """Drafts accepted earlier in a verification span count for the rows after them."""
    llm = LLM(
        tiny_llama,
        num_kv_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "max_draft_skip": 0},
    )
    outs = llm.generate(PROMPTS, PENALISED, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs
    stats = llm.llm_engine.get_stats()
    assert stats.num_accepted_tokens > 0 and stats.accepted_by_position[1] > 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks
