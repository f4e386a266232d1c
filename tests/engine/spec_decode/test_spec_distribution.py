"""Sampling with speculation follows the target's law exactly: thousands of engine samples of a
tiny-vocabulary random target, against the joint law of the first output tokens computed with HF
transformers, by a chi-square test at p = 1e-4.

Drafts start after the first output token (that one comes from the prefill), so the joint covers
output tokens 0..3: tokens 1..3 went through verification (accepted drafts, recovered tokens and
bonus tokens). With speculation off the same test is a control of the test itself.

The penalised cases make row j of a verification span depend on the drafts before it (they
count as generated tokens there): a verifier that counted only the committed tokens would give
a p that no plain decode samples from, and fails them.

The constrained cases (a regex, structured outputs) compare against the masked target's law:
they fail with a verifier that masks only the first row of a span (not the rows after each
draft) and with a drafter that samples from its masked q but reports the unmasked one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import build_random_eagle_head, build_random_llama
from stats import chi_square_test
from transformers import LlamaForCausalLM

from pagedspec import LLM, SamplingParams
from pagedspec.engine.config import METHOD_DEFAULTS

VOCAB = 8
PROMPT = [1, 5, 3, 1, 5, 3, 7]  # repeats, so n-gram lookup finds drafts
MAX_TOKENS = 4
NUM_SAMPLES = 6000
P_VALUE = 1e-4
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    logit_std=1.5,  # peaked, far from uniform and from one-hot
)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_random_llama(tmp_path_factory.mktemp("dist_target"), seed=10, **SHAPE)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target) -> dict[str, str]:
    return {
        # an unrelated model: its greedy drafts are mostly rejected
        "other": build_random_llama(
            tmp_path_factory.mktemp("dist_other"), seed=11, **(SHAPE | {"num_hidden_layers": 1})
        ),
        # the target's weights plus noise: drafts accepted about half the time
        "noisy": build_random_llama(
            tmp_path_factory.mktemp("dist_noisy"), seed=12, like=target, noise=0.5
        ),
        # a random EAGLE head drafting from 6 of the 8 tokens
        "eagle": build_random_eagle_head(tmp_path_factory.mktemp("dist_eagle"), target, 6),
    }


# strong enough that a token accepted as a draft moves the next rows' law a lot
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.6)


def penalised(logits: torch.Tensor, prefixes: torch.Tensor, params: dict) -> torch.Tensor:
    """vLLM's penalties on logits [P, 4, V]: row i of prefix n follows PROMPT and its first i
    output tokens ``prefixes[n, :i]``."""
    if not params:
        return logits
    one_hot = torch.nn.functional.one_hot(prefixes, VOCAB).double()  # [P, 3, V]
    counts = torch.cat([torch.zeros_like(one_hot[:, :1]), one_hot.cumsum(1)], dim=1)  # [P, 4, V]
    in_prompt = torch.zeros(VOCAB, dtype=torch.bool)
    in_prompt[PROMPT] = True
    r = params["repetition_penalty"]
    seen = (counts > 0) | in_prompt
    out = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return out - params["frequency_penalty"] * counts - params["presence_penalty"] * (counts > 0)


@pytest.fixture(scope="module")
def exact_joint(target):
    """(temperature, penalties) -> float64 [V, V, V, V]: P(output tokens 0..3 = (a, b, c, d))."""
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float64).eval()
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=MAX_TOKENS - 1)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1 :]  # [V^3, 4, V]: next-token logits

    def joint(temperature: float, penalties: dict) -> torch.Tensor:
        scaled = penalised(logits, prefixes, penalties) / temperature
        probs = scaled.softmax(-1).reshape(VOCAB, VOCAB, VOCAB, MAX_TOKENS, VOCAB)
        p0 = probs[0, 0, 0, 0]  # P(t0 | prompt)
        p1 = probs[:, 0, 0, 1]  # P(t1 | t0): [t0, t1]
        p2 = probs[:, :, 0, 2]  # P(t2 | t0, t1)
        p3 = probs[:, :, :, 3]  # P(t3 | t0, t1, t2)
        return p0[:, None, None, None] * p1[:, :, None, None] * p2[..., None] * p3

    return joint


def sample_joint(llm: LLM, temperature: float, penalties: dict) -> torch.Tensor:
    """Counts [V, V, V, V] of the engine's first four output tokens over NUM_SAMPLES samples."""
    params = SamplingParams(
        n=NUM_SAMPLES, temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True, **penalties
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == NUM_SAMPLES
    ids = torch.tensor([c.token_ids for c in out.outputs])
    assert ids.shape == (NUM_SAMPLES, MAX_TOKENS)
    flat = sum(ids[:, i] * VOCAB ** (MAX_TOKENS - 1 - i) for i in range(MAX_TOKENS))
    return torch.bincount(flat, minlength=VOCAB**MAX_TOKENS).reshape([VOCAB] * MAX_TOKENS)


def make_llm(target: str, drafts: dict[str, str], method: str) -> LLM:
    spec = None
    common = {"num_speculative_tokens": 3, "disable_batch_size": 10**6, "max_draft_skip": 0,
              "disable_tree_batch_size": 10**6}  # fmt: skip
    if method == "ngram":
        spec = {"method": "ngram", **common}
    elif method.startswith("draft-"):
        spec = {"method": "draft", "draft_model": drafts[method[6:]], **common}
    elif method.startswith("eagle"):
        spec = {"method": "eagle", "draft_model": drafts["eagle"], **common}
        if method == "eagle-tree":  # leaves beside the chain: a tree of 3 + 6 drafts
            spec["draft_leaves"] = 6
    return LLM(
        target,
        num_kv_blocks=NUM_SAMPLES + 64,
        max_num_seqs=NUM_SAMPLES,
        max_num_batched_tokens=8 * NUM_SAMPLES,
        speculative_config=spec,
    )


@pytest.mark.parametrize(
    "method, temperature, penalties",
    [
        ("off", 1.0, {}),  # control: the test itself accepts plain sampling
        ("ngram", 1.0, {}),
        ("draft-other", 1.0, {}),
        ("draft-noisy", 1.0, {}),
        ("draft-noisy", 0.7, {}),
        ("ngram", 0.7, {}),
        ("eagle", 1.0, {}),
        ("eagle", 0.7, {}),
        ("off", 1.0, PENALTIES),  # control: the penalised law and plain penalised sampling
        ("draft-noisy", 1.0, PENALTIES),  # sampled drafts: rejection sampling
        ("eagle", 1.0, PENALTIES),  # sampled drafts over a reduced vocabulary
        ("eagle-tree", 1.0, {}),  # a token from a leaf's row where the chain stopped at it
        ("eagle-tree", 0.7, PENALTIES),
        ("ngram", 1.0, PENALTIES),  # deterministic drafts: sample and match
    ],
    ids=lambda v: ("penalties" if v else "plain") if isinstance(v, dict) else None,
)
def test_speculative_sampling_follows_the_target_joint_law(
    target, drafts, exact_joint, method, temperature, penalties
):
    llm = make_llm(target, drafts, method)
    counts = sample_joint(llm, temperature, penalties)
    law = exact_joint(temperature, penalties)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    if method != "off":
        # the premise: many verification rounds, with both acceptances and rejections
        assert stats.num_draft_tokens > NUM_SAMPLES
        assert 0.03 < stats.acceptance_rate < 0.97, stats
    if method == "eagle":  # the default chain stop (min_draft_confidence) ends some chains early
        drafts = stats.num_draft_tokens / stats.num_verifications  # and the default tree's leaves
        leaves = METHOD_DEFAULTS["eagle"]["draft_leaves"]
        assert 1.2 + leaves < drafts < 2.8 + leaves, stats
    if method == "eagle-tree":  # many rounds end at a leaf, many do not
        assert 0.1 * stats.num_verifications < stats.num_leaf_tokens, stats
        assert stats.num_leaf_tokens < 0.9 * stats.num_verifications, stats
    # tokens 1..3 (every one of them drafted and verified at least some of the time), jointly
    stat, threshold, df = chi_square_test(counts.sum(0), law.sum(0), P_VALUE)
    assert stat < threshold, f"tokens 1..3: chi2 {stat:.1f} >= {threshold:.1f} (df {df}); {stats}"
    # all four jointly: verification must also condition correctly on token 0
    stat, threshold, df = chi_square_test(counts, law, P_VALUE)
    assert stat < threshold, f"tokens 0..3: chi2 {stat:.1f} >= {threshold:.1f} (df {df}); {stats}"


# --- structured outputs: the law of the masked target ---------------------------------------
# Token i < 7 is the letter "abcdefg"[i], 7 is EOS. The regex takes pairs whose second letter
# depends on the first, three pairs or more: EOS is refused in the first four tokens, and the
# mask of every odd position depends on the token before it (drafted or not).
PAIRS = {0: (1, 2), 1: (0, 3), 2: (0, 1), 3: (2, 3)}  # a: ab ac, b: ba bd, c: ca cb, d: dc dd
REGEX = "(" + "|".join(f"{'abcd'[a]}[{''.join('abcd'[b] for b in bs)}]" for a, bs in PAIRS.items())
REGEX += "){3,}"
PROMPT_LETTERS = [0, 1, 2, 0, 0, 1, 2, 0, 3, 3]  # ab ca ab ca dd: n-gram lookup finds drafts


def allowed_after(prefix: list[int]) -> list[int]:
    """(A prefix REGEX refuses has probability 0: what follows it is left unmasked.)"""
    return list(PAIRS) if len(prefix) % 2 == 0 else list(PAIRS.get(prefix[-1], range(VOCAB)))


@pytest.fixture(scope="module")
def lettered(tmp_path_factory, target) -> str:
    """The target's weights with a tokenizer of letters (EOS 7): what a constraint needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("dist_lettered")
    model = LlamaForCausalLM.from_pretrained(target)
    model.config.eos_token_id, model.config.bos_token_id = 7, None
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefg")} | {"</s>": 7},
                               merges=[]))  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def exact_masked_joint(target):
    """temperature -> float64 [V, V, V, V]: the law of output tokens 0..3 when each is drawn
    from the target's softmax over the tokens REGEX allows after the ones before it."""
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float64).eval()
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=MAX_TOKENS - 1)))
    ids = torch.cat([torch.tensor(PROMPT_LETTERS).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT_LETTERS) - 1 :]  # [V^3, 4, V]
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for n, prefix in enumerate(prefixes.tolist()):
        for i in range(MAX_TOKENS):
            allowed[n, i, allowed_after(prefix[:i])] = True

    def joint(temperature: float) -> torch.Tensor:
        scaled = (logits / temperature).masked_fill(~allowed, float("-inf"))
        probs = scaled.softmax(-1).reshape(VOCAB, VOCAB, VOCAB, MAX_TOKENS, VOCAB)
        p0, p1, p2, p3 = probs[0, 0, 0, 0], probs[:, 0, 0, 1], probs[:, :, 0, 2], probs[:, :, :, 3]
        return p0[:, None, None, None] * p1[:, :, None, None] * p2[..., None] * p3

    return joint


@pytest.mark.parametrize(
    "method, temperature",
    [("off", 1.0), ("ngram", 1.0), ("ngram", 0.7), ("draft-noisy", 1.0), ("draft-noisy", 0.7),
     ("eagle", 1.0), ("eagle", 0.7), ("eagle-tree", 1.0), ("eagle-tree", 0.7)],
)  # fmt: skip
def test_constrained_speculative_sampling_follows_the_masked_target_law(
    lettered, drafts, exact_masked_joint, method, temperature
):
    llm = make_llm(lettered, drafts, method)
    params = SamplingParams(n=NUM_SAMPLES, temperature=temperature, max_tokens=MAX_TOKENS,
                            structured_outputs={"regex": REGEX})  # fmt: skip
    (out,) = llm.generate([PROMPT_LETTERS], params, use_tqdm=False)
    ids = torch.tensor([c.token_ids for c in out.outputs])
    assert ids.shape == (NUM_SAMPLES, MAX_TOKENS)
    flat = sum(ids[:, i] * VOCAB ** (MAX_TOKENS - 1 - i) for i in range(MAX_TOKENS))
    counts = torch.bincount(flat, minlength=VOCAB**MAX_TOKENS).reshape([VOCAB] * MAX_TOKENS)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    if method != "off":  # the premise: drafts verified, some accepted and some not
        assert stats.num_draft_tokens > NUM_SAMPLES // 2, stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    if method == "eagle-tree":  # some rounds end at a leaf, under the mask after its chain
        assert stats.num_leaf_tokens > NUM_SAMPLES // 20, stats
    law = exact_masked_joint(temperature)
    stat, threshold, df = chi_square_test(counts, law, P_VALUE)
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f} (df {df}); {stats}"
