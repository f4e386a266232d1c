"""The EAGLE head's file format, its training module, and the training script end to end at a
tiny size."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pagedspec.engine.sample.round import NoSpeculation
from pagedspec.engine.spec_decode import eagle_format
from pagedspec.engine.tools.train_eagle import cli, data, features, losses, magpie, prompts
from pagedspec.engine.tools.train_eagle.batches import choose_draft_vocab, split, target_to_draft
from pagedspec.engine.tools.train_eagle.head import EagleHead, shift_right, step_mask
from pagedspec.engine.tools.train_eagle.prompts import make_prompts

TINY = LlamaConfig(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rope_theta=500.0,
)  # fmt: skip


def tiny_head(
    draft_vocab: int = 10, seed: int = 0, feature_layers: tuple[int, ...] = ()
) -> tuple[dict, dict]:
    layer = eagle_format.layer_config_from_hf(TINY)
    config = eagle_format.make_config(layer, draft_vocab, TINY.vocab_size, "tiny", feature_layers)
    torch.manual_seed(seed)
    shapes = eagle_format.expected_shapes(config)
    sd = {k: torch.randn(s) for k, s in shapes.items() if k != "d2t"}
    sd["d2t"] = torch.sort(torch.randperm(TINY.vocab_size)[:draft_vocab]).values
    return sd, config


def test_layer_config_fields():
    layer = eagle_format.layer_config_from_hf(TINY)
    assert set(layer) == set(eagle_format.LAYER_CONFIG_FIELDS)
    assert layer["rope_theta"] == 500.0 and layer["rope_scaling"] is None
    assert layer["head_dim"] == 8 and layer["num_key_value_heads"] == 2
    rebuilt = eagle_format.llama_config(layer)
    assert rebuilt.num_hidden_layers == 1 and rebuilt.rope_parameters["rope_theta"] == 500.0


@pytest.mark.parametrize("layers", [(), (1, 5)], ids=["eagle1", "eagle3"])
def test_save_load_round_trip(tmp_path, layers):
    sd, config = tiny_head(feature_layers=layers)
    assert config["architecture"] == ("eagle3" if layers else "eagle1")
    assert eagle_format.feature_layers(config) == layers
    assert ("fuse.weight" in sd) == bool(layers)
    sd = {k: v if k == "d2t" else v.to(torch.bfloat16) for k, v in sd.items()}
    eagle_format.save_head(str(tmp_path), sd, config, {"steps": 3})
    loaded, cfg = eagle_format.load_head(str(tmp_path))
    assert cfg == config
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    assert eagle_format.load_manifest(str(tmp_path)) == {"steps": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "manifest.json", "model.safetensors",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda sd, c: sd.pop("fc.weight"), "missing \\['fc.weight'\\]"),
        (lambda sd, c: sd.update(extra=torch.zeros(1)), "unexpected \\['extra'\\]"),
        (lambda sd, c: sd.update({"lm_head.weight": torch.zeros(9, 32)}), "lm_head.weight"),
        (lambda sd, c: sd.update(d2t=sd["d2t"].flip(0)), "ascending"),
        (lambda sd, c: sd.update(d2t=sd["d2t"].int()), "int64"),
        (lambda sd, c: sd["d2t"].__setitem__(-1, 100), "outside"),
        (lambda sd, c: sd.update({"fc.weight": sd["fc.weight"].long()}), "dtype"),
        (lambda sd, c: c.update(architecture="eagle2"), "architecture"),
        (lambda sd, c: c.update(feature_layers=[1]), "feature_layers is for architecture"),
        (lambda sd, c: c.update(architecture="eagle3"), "feature_layers must be a non-empty"),
        (lambda sd, c: c.pop("target_vocab_size"), "missing \\['target_vocab_size'\\]"),
        (lambda sd, c: c["layer_config"].pop("rope_theta"), "layer_config is missing"),
        (lambda sd, c: c.update(hidden_size=64), "hidden_size"),
        (lambda sd, c: c.update(draft_vocab_size=1000), "exceeds"),
        (lambda sd, c: c["layer_config"].update(attention_bias=True), "bias"),
    ],
)
def test_save_head_rejects(tmp_path, change, message):
    sd, config = tiny_head()
    change(sd, config)
    with pytest.raises(ValueError, match=message):
        eagle_format.save_head(str(tmp_path), sd, config)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("layers", [[], [2, 1], [1, 1], [-1], [True], "1"])
def test_eagle3_feature_layers_must_be_ascending_indices(tmp_path, layers):
    sd, config = tiny_head(feature_layers=(1, 2))
    config["feature_layers"] = layers
    with pytest.raises(ValueError, match="feature_layers must be a non-empty ascending list"):
        eagle_format.save_head(str(tmp_path), sd, config)


def test_eagle3_head_needs_its_fuse_weight(tmp_path):
    sd, config = tiny_head(feature_layers=(1, 2))
    assert sd["fuse.weight"].shape == (32, 3 * 32)
    sd.pop("fuse.weight")
    with pytest.raises(ValueError, match="missing \\['fuse.weight'\\]"):
        eagle_format.save_head(str(tmp_path), sd, config)


def test_load_head_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        eagle_format.load_head(str(tmp_path))
    sd, config = tiny_head()
    eagle_format.save_head(str(tmp_path), sd, config)
    bad = dict(config, draft_vocab_size=11)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="shape"):
        eagle_format.load_head(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        eagle_format.load_head(str(tmp_path))


def _head_and_inputs(seed=0, length=12):
    layer = eagle_format.layer_config_from_hf(TINY)
    torch.manual_seed(seed)
    head = EagleHead(layer, 10).eval()
    with torch.no_grad():  # larger weights than the init, so attention is far from uniform
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head, torch.randn(2, length, 32), torch.randn(2, length, 32)


def test_head_step0_matches_hf_decoder_layer():
    head, emb, feat = _head_and_inputs()
    ours = head(emb, feat, steps=1)[0]
    cfg = eagle_format.llama_config(eagle_format.layer_config_from_hf(TINY))
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.load_state_dict(head.layer.state_dict())
    x = head.fc(torch.cat([emb, shift_right(feat)], -1))
    pos = torch.arange(emb.shape[1]).unsqueeze(0)
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    ref = layer(x, attention_mask=mask, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_unrolled_steps_equal_a_chain_draft():
    """Step s at position i equals a plain causal pass where the inputs of positions
    i-s+1..i use the head's own previous outputs instead of the target's features."""
    head, emb, feat = _head_and_inputs(seed=1)
    with torch.no_grad():
        outs = head(emb, feat, steps=3)
        for s in (1, 2):
            for i in range(s, 12):
                mod = feat[:, : i + 1].clone()
                for t in range(1, s + 1):  # position i-s+t reads mod[i-s+t-1] = h^{(t-1)}
                    mod[:, i - s + t - 1] = outs[t - 1][:, i - s + t - 1]
                ref = head(emb[:, : i + 1], mod, steps=1)[0][:, i]
                torch.testing.assert_close(outs[s][:, i], ref, atol=1e-5, rtol=1e-5)


def test_step_mask_rows():
    m = step_mask(4, 1)
    assert m[3].tolist() == [True, True, True, False] + [False, False, False, True]
    assert m[0].tolist() == [False] * 4 + [True, False, False, False]


def test_draft_vocab_is_most_frequent_answer_tokens():
    convs = [
        {"tokens": torch.tensor([9, 9, 9, 5, 5, 7, 3, 3, 3, 3]), "prompt_len": 3},
        {"tokens": torch.tensor([1, 2, 5, 7, 7]), "prompt_len": 2},
    ]
    d2t = choose_draft_vocab(convs, 12, 3)
    assert d2t.tolist() == [3, 5, 7]  # answers: 3 x4, 5 x3, 7 x3
    # then prompt tokens (9 x3, then 1 and 2 x1: the lower id wins)
    assert choose_draft_vocab(convs, 12, 5).tolist() == [1, 3, 5, 7, 9]
    t2d = target_to_draft(d2t, 12)
    assert t2d[5] == 1 and t2d[0] == -100


def test_prompts_are_deterministic_and_distinct():
    a = make_prompts(300, seed=3)
    assert a == make_prompts(300, seed=3) and len(set(a)) == 300
    assert make_prompts(50, seed=3) == a[:50]
    assert a != make_prompts(300, seed=4)


def test_prompts_mix_in_chat_templates_after_the_base_ones():
    """The first BASE_ONLY prompts are the base templates alone (cached answers of the shipped
    head stay valid); after them every other prompt is an everyday-chat one."""
    n = prompts.BASE_ONLY + 200
    a = make_prompts(n)
    assert len(set(a)) == n and a[: prompts.BASE_ONLY] == make_prompts(prompts.BASE_ONLY)

    def patterns(templates) -> list[re.Pattern]:
        return [re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(t)), re.I) for t, _ in templates]

    chat, base = patterns(prompts.CHAT_TEMPLATES), patterns(prompts.TEMPLATES)

    def is_chat(text: str) -> bool:
        return any(p.match(text) for p in chat) and not any(p.match(text) for p in base)

    assert not any(map(is_chat, a[: prompts.BASE_ONLY]))
    assert sum(map(is_chat, a[prompts.BASE_ONLY :])) > 40


class _FakeAnswer:
    """``data.answer`` stand-in: answers each conversation with as many tokens as its prompt has
    characters, no features; raises on the call numbered ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, llm, conversations, temperatures, max_tokens, layers):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("killed mid-stage")
        records = [
            {"prompt_ids": [1, 2], "answer_ids": [3] * len(c[0]["content"]), "temperature": t,
             "finish_reason": "stop"}
            for c, t in zip(conversations, temperatures, strict=True)
        ]  # fmt: skip
        return records, None


def test_answer_timings_survive_a_killed_run(tmp_path, monkeypatch):
    """Each finished chunk's tokens and seconds are recorded as it is written: a run killed in
    its second chunk has recorded the first, and the resumed run records the rest once."""
    prompts = [f"question {'?' * i}" for i in range(10)]
    recorded: list[dict] = []
    monkeypatch.setattr(data, "answer", _FakeAnswer(fail_at=2))
    with pytest.raises(KeyboardInterrupt):
        data.generate_answers(lambda: None, prompts, str(tmp_path), 8, 4, recorded.append)
    assert [r["answer_tokens"] for r in recorded] == [sum(len(p) for p in prompts[:4])]
    # a feature file the killed run had written for its unfinished chunk is another draw's
    stale = data.feature_path(str(tmp_path), "answers", "chunk_00001.jsonl")
    os.makedirs(os.path.dirname(stale))
    save_file({"features": torch.zeros(1, 4)}, stale)
    monkeypatch.setattr(data, "answer", _FakeAnswer())
    data.generate_answers(lambda: None, prompts, str(tmp_path), 8, 4, recorded.append)
    written = data.load_conversations(str(tmp_path))
    assert [r["prompt"] for r in written] == prompts
    assert sum(r["answer_tokens"] for r in recorded) == sum(len(r["answer_ids"]) for r in written)
    assert len(recorded) == 3 and all(r["seconds"] >= 0 for r in recorded)
    assert not os.path.exists(stale)


def _prefilled(model: str, convs: list[dict], layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Stage 2's teacher-forced features of each conversation's tokens."""
    runner = features.target_runner(model, 512)
    return features.sequence_features(runner, [c["tokens"].tolist() for c in convs], 256, layers)


def test_stage_1_captures_the_features_stage_2_would_compute(tiny_llama, tmp_path):
    """Stage 1 writes each chunk's features (layer 0's hidden states and the final ones) as it
    answers, so stage 2 has nothing left to do: stage 2's teacher-forced features of the same
    tokens, but zeros for each conversation's last token (sampled, never fed)."""
    topics = ["foxes", "dogs", "rain"] * 3
    prompts = [f"Tell me {i} things about {w}." for i, w in enumerate(topics)]
    work = str(tmp_path)
    data.generate_answers(lambda: data.make_llm(tiny_llama, 4, 0), prompts, work, 12, 4,
                          layers=(0,))  # fmt: skip
    features.compute_features(lambda: pytest.fail("stage 2 ran"), work, "answers", layers=(0,))
    convs, records = features.load_features(work, "answers"), data.load_conversations(work)
    assert len(convs) == len(records) == len(prompts)
    for conv, record in zip(convs, records, strict=True):
        whole = record["prompt_ids"] + record["answer_ids"]
        assert conv["tokens"].tolist() == whole
        assert conv["prompt_len"] == len(record["prompt_ids"])
    for conv, want in zip(convs, _prefilled(tiny_llama, convs, (0,)), strict=True):
        got = conv["features"]
        assert got.dtype == torch.bfloat16
        assert got.shape == want.shape == (len(conv["tokens"]), 2 * 64)
        torch.testing.assert_close(got[:-1].float(), want[:-1].float(), rtol=0.02, atol=2e-3)
        assert not got[-1].any()


def test_captured_features_survive_chunked_prefill_and_preemption(tiny_llama):
    """Prompt chunks, decode steps, and a preempted sequence's recomputation: each position's
    features are those of its last computation, equal to a teacher-forced prefill's."""
    from pagedspec import LLM, SamplingParams
    from pagedspec.engine.tools.train_eagle.capture import generate_with_features

    llm = LLM(tiny_llama, num_kv_blocks=12, max_num_batched_tokens=24, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (40, 9, 33, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    outs, feats = generate_with_features(llm, prompts, params, ())
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_total_blocks
    convs = [{"tokens": torch.tensor(p + list(o.outputs[0].token_ids)[:-1])}
             for p, o in zip(prompts, outs, strict=True)]  # fmt: skip
    for got, want in zip(feats, _prefilled(tiny_llama, convs, ()), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=2e-3)
    assert type(llm.llm_engine.spec) is NoSpeculation  # the engine's own round is back
    with pytest.raises(ValueError, match="without prefix caching"):
        generate_with_features(LLM(tiny_llama, num_kv_blocks=16), prompts, params, ())


def test_a_failed_capture_leaves_the_engine_as_it_was(tiny_llama, monkeypatch):
    """A step that raises mid-capture: the engine gets its own speculation manager back, the
    capture's requests are aborted (no block held), and the engine answers normally after."""
    from pagedspec import LLM, SamplingParams
    from pagedspec.engine.tools.train_eagle.capture import generate_with_features

    llm = LLM(tiny_llama, num_kv_blocks=32, enable_prefix_caching=False)
    engine, manager = llm.llm_engine, llm.llm_engine.spec
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed mid-capture")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        generate_with_features(llm, [[5, 6, 7], [8, 9]], params, ())
    monkeypatch.setattr(engine, "step", step)
    assert engine.spec is manager and not engine.requests
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    outs, feats = generate_with_features(llm, [[5, 6, 7], [8, 9]], params, ())  # its aborts
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]  # are skipped
    assert [len(f) for f in feats] == [3 + 7, 2 + 7]


class _CharTokenizer:
    """A tokenizer of one id per character and the template ``<s>user: {text}``."""

    chat_template = "<s>user: {text}"

    def apply_chat_template(self, messages, tokenize):
        return f"<s>user: {messages[0]['content']}"

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


class _FakeWriter:
    """``LLM.generate`` stand-in for Magpie: each round answers every prompt with the next of
    ``rounds`` (text, finish reason) lists, cycling; records the prompts it was given."""

    def __init__(self, rounds: list[list[tuple[str, str]]]) -> None:
        self.rounds, self.prompts = rounds, []
        self.tokenizer = _CharTokenizer()

    def generate(self, prompts, params, use_tqdm=False):
        self.prompts.append(prompts)
        texts = self.rounds[(len(self.prompts) - 1) % len(self.rounds)]
        return [
            SimpleNamespace(outputs=[SimpleNamespace(text=t, finish_reason=r)])
            for t, r in (texts[i % len(texts)] for i in range(len(prompts)))
        ]


def test_magpie_keeps_new_finished_plain_prompts(tmp_path):
    """Stage 0 feeds the template's user-turn prefix and keeps only messages the model ended,
    of a sensible length, plain text, never a repeat (of its own or of ``seen``); the result
    is cached; too few usable messages is an error that says so."""
    good = "How do I keep basil alive on a windowsill?"
    rounds = [[
        (good, "stop"),
        (f"  {good.upper()} ", "stop"),  # a repeat, case and spacing aside
        ("Plan a picnic for six people in the park.", "length"),  # cut off
        ("Hi there", "stop"),  # too short
        (" ".join(["word"] * (magpie.MAX_WORDS + 1)), "stop"),  # too long
        ("Écrivez un poème sur la mer, s'il vous plaît, très ému.", "stop"),  # not ASCII
        ("Tell me about foxes and where they live.", "stop"),  # seen (a held-out prompt)
    ], [
        ("Why do cats purr when they are happy?", "stop"),
        ("Write a haiku about the first snow of winter.", "stop"),
    ]]  # fmt: skip
    writer = _FakeWriter(rounds)
    seen = ["tell me about foxes and  where they live."]
    done: list[dict] = []
    out = magpie.synthesize_prompts(lambda: writer, 3, str(tmp_path), seen, batch_size=7,
                                    on_done=done.append)  # fmt: skip
    assert out == [good, "Why do cats purr when they are happy?",
                   "Write a haiku about the first snow of winter."]  # fmt: skip
    assert writer.prompts[0] == [[ord(c) for c in "<s>user:"]] * 7
    assert len(done) == 1 and done[0]["written"] == 14 and done[0]["seconds"] >= 0
    assert magpie.synthesize_prompts(lambda: None, 3, str(tmp_path), on_done=done.append) == out
    assert len(done) == 1  # cached: nothing written, nothing recorded
    with pytest.raises(ValueError, match="holds 3 prompts, not 2"):
        magpie.synthesize_prompts(lambda: None, 2, str(tmp_path))
    with pytest.raises(ValueError, match="only 1 usable prompts of 3 in 4 rounds of 7; ask for "
                                         "at most 1"):  # fmt: skip
        magpie.synthesize_prompts(lambda: _FakeWriter(rounds[:1]), 3, str(tmp_path / "b"), seen,
                                  batch_size=7, max_rounds=4)  # fmt: skip


def test_magpie_prefix_is_how_every_real_prompt_starts(tiny_llama, tmp_path):
    """The prefix is the leading token ids of real chat prompts (the tiny template has a space
    before the user's text, which the tokenizer joins to some first words and not to others:
    the prefix leaves it out)."""
    from transformers import AutoTokenizer

    from pagedspec.engine.entrypoints.llm import render_chat

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prefix = magpie.user_turn_prefix(tok)
    assert tok.decode(prefix) == "<s>user:"
    for text in ("hello there", "the quick fox", "Speculative decoding?", "a", "zzz"):
        ids = render_chat(tok, [{"role": "user", "content": text}])[1]
        assert ids[: len(prefix)] == prefix, text
    # through the real engine: the random tiny model writes no usable message
    with pytest.raises(ValueError, match="only 0 usable prompts of 2 in 1 rounds of 8"):
        magpie.synthesize_prompts(lambda: data.make_llm(tiny_llama, 8, 0), 2, str(tmp_path),
                                  batch_size=8, max_rounds=1)  # fmt: skip
    tok.chat_template = "{{ messages[0]['role'] }}"
    with pytest.raises(ValueError, match="does not show the user's message"):
        magpie.user_turn_prefix(tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        magpie.user_turn_prefix(tok)


class _Stop(Exception):
    pass


def test_cli_hands_stage_0_the_prompts_it_must_not_repeat(tmp_path, monkeypatch, tiny_llama):
    """--magpie-prompts N: stage 0 is asked for N prompts, with the template prompts and the
    held-out chat ones as seen, and meta.json pins N (without the flag it has no such key, so
    older work dirs keep matching)."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Foxes?"}]}) + "\n")
    asked = {}

    def fake(llm_factory, count, work_dir, seen, on_done=None):
        asked.update(count=count, seen=list(seen))
        raise _Stop

    monkeypatch.setattr(magpie, "synthesize_prompts", fake)
    work = tmp_path / "work"
    argv = ["--model", tiny_llama, "--out", str(tmp_path / "head"), "--work-dir", str(work),
            "--num-prompts", "5", "--heldout-chat", str(chat)]  # fmt: skip
    with pytest.raises(_Stop):
        cli.main([*argv, "--magpie-prompts", "3"])
    assert asked == {"count": 3, "seen": make_prompts(5) + ["Foxes?"]}
    assert json.loads((work / "meta.json").read_text())["magpie_prompts"] == 3
    with pytest.raises(ValueError, match="holds data made with"):
        cli.main(argv)  # the same work dir without the flag is another configuration


def test_cli_puts_the_prompts_file_last_and_refuses_held_out_lines(
    tmp_path, monkeypatch, tiny_llama
):
    """--prompts-file: its lines follow the template and Magpie prompts into stage 1, stage 0
    must not repeat them, meta.json pins the file's content, and a held-out chat prompt in it
    (case and spacing aside) is a ValueError before any stage."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Foxes?"}]}) + "\n")
    extra = tmp_path / "extra.txt"
    extra.write_text("How do owls hunt?\n\n  Why is snow white?  \n")
    seen, answered = {}, {}

    def fake_magpie(llm_factory, count, work_dir, seen_prompts, on_done=None):
        seen["prompts"] = list(seen_prompts)
        return ["A Magpie prompt."]

    def fake_answers(llm_factory, prompts, *args, **kwargs):
        answered["prompts"] = list(prompts)
        raise _Stop

    monkeypatch.setattr(magpie, "synthesize_prompts", fake_magpie)
    monkeypatch.setattr(data, "generate_answers", fake_answers)
    work = tmp_path / "work"
    argv = ["--model", tiny_llama, "--out", str(tmp_path / "head"), "--work-dir", str(work),
            "--num-prompts", "3", "--heldout-chat", str(chat), "--magpie-prompts", "1"]  # fmt: skip
    with pytest.raises(_Stop):
        cli.main([*argv, "--prompts-file", str(extra)])
    file_prompts = ["How do owls hunt?", "Why is snow white?"]
    assert seen["prompts"] == make_prompts(3) + file_prompts + ["Foxes?"]
    assert answered["prompts"] == make_prompts(3) + ["A Magpie prompt."] + file_prompts
    assert "prompts_file_sha256" in json.loads((work / "meta.json").read_text())
    extra.write_text("How do owls hunt?\n")
    with pytest.raises(ValueError, match="holds data made with"):
        cli.main([*argv, "--prompts-file", str(extra)])  # another file is another data set
    extra.write_text("How do owls hunt?\n  foxes? \n")
    with pytest.raises(ValueError, match=r"--prompts-file .*1 line\(s\) are held-out .*'foxes\?'"):
        cli.main([*argv, "--prompts-file", str(extra), "--work-dir", str(tmp_path / "w2")])
    assert not (tmp_path / "w2").exists()  # checked before any stage


def test_engine_features_equal_hf_teacher_forcing(tiny_llama):
    """Stage 2 runs the engine's target over packed prefills of several conversations (spans
    of different lengths, more of them than fit one forward): each one's features are HF's
    post-norm last hidden states of that conversation alone."""
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 5, 70, 16, 1, 33, 64]
    seqs = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in lengths]
    runner = features.target_runner(tiny_llama, 96)
    ours = features.sequence_features(runner, seqs, batch_tokens=80)
    hf = features.load_target(tiny_llama)
    for seq, got in zip(seqs, ours, strict=True):
        with torch.inference_mode():
            want = hf.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(
            got.float(), want.to(torch.bfloat16).float(), rtol=0.01, atol=1e-3
        )
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        features.sequence_features(runner, [[5] * 97], batch_tokens=80)
    # an eagle3 head's: layer 0's hidden states (HF's hidden_states[1]), then the final ones
    fused = features.sequence_features(runner, seqs[:3], batch_tokens=80, layers=(0,))
    for seq, got, final in zip(seqs[:3], fused, ours[:3], strict=True):
        with torch.inference_mode():
            want = hf.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        torch.testing.assert_close(
            got[:, :64].float(), want.hidden_states[1][0].to(torch.bfloat16).float(),
            rtol=0.01, atol=1e-3,
        )  # fmt: skip
        assert torch.equal(got[:, 64:], final)


def test_training_script_end_to_end(tmp_path):
    model = build_tiny_llama(tmp_path / "model")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
        for q in ("Tell me about foxes.", "What is paged attention?")
    ))  # fmt: skip
    out, work = tmp_path / "head", tmp_path / "work"
    argv = [
        "--model", model, "--out", str(out), "--work-dir", str(work), "--num-prompts", "12",
        "--max-tokens", "16", "--draft-vocab-size", "64", "--steps", "150", "--batch-size", "4",
        "--lr", "3e-3", "--chunk-size", "6", "--heldout-fraction", "0.2", "--max-num-seqs", "8",
        "--heldout-chat", str(chat), "--autocast", "bfloat16", "--checkpoint-every", "20",
        "--eval-steps", "3",
    ]  # fmt: skip
    manifest = cli.main(argv)
    sd, config = eagle_format.load_head(str(out))
    assert config["draft_vocab_size"] == 64 and config["hidden_size"] == 64
    assert config["layer_config"]["num_key_value_heads"] == 2
    assert {k: tuple(v.shape) for k, v in sd.items()} == eagle_format.expected_shapes(config)
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
    head = EagleHead.from_dir(str(out))
    torch.testing.assert_close(head.lm_head.weight, sd["lm_head.weight"].float())
    first, last = manifest["training"]["first_logged"], manifest["training"]["last_logged"]
    assert manifest["training"]["bf16_autocast"]
    assert last["step"] == 149 and last["loss"] < 0.6 * first["loss"], (first, last)
    chat = manifest["eval"]["heldout_chat"]
    assert len(chat["acc_greedy"]) == 3 and 0 < chat["sampled_accept"] <= 1
    # chain stops: a higher threshold drafts no more and accepts no more than a lower one
    stops = [chat["chain_stop"][str(tau)] for tau in losses.CHAIN_STOPS]
    drafts = [s["drafts_per_round"] for s in stops]
    tokens = [s["tokens_per_round"] for s in stops]
    assert drafts[0] <= 3 and drafts == sorted(drafts, reverse=True) and 1 <= drafts[-1] < 3
    assert chat["tokens_per_round"] >= tokens[0] and tokens == sorted(tokens, reverse=True)
    assert manifest["data"]["sequences"] == 12 and manifest["data"]["magpie_prompts"] == 0
    assert "magpie_prompts" not in json.loads((work / "meta.json").read_text())
    assert json.loads((out / "manifest.json").read_text())["command"].endswith("3")
    # a re-run resumes everything from the work dir: nothing is regenerated or retrained
    again = cli.main(argv)
    assert again["eval"] == manifest["eval"]
    train_s = manifest["timings_seconds"]["stage3_train"]["seconds_total"]
    assert again["timings_seconds"]["stage3_train"]["seconds_total"] == train_s  # not twice
    # an eagle3 head on the same conversations: stage 2 is redone with layer 0's hidden states
    out3 = tmp_path / "head3"
    argv3 = [str(out3) if a == str(out) else a for a in argv]
    fused = cli.main([*argv3, "--feature-layers", "0"])
    sd3, config3 = eagle_format.load_head(str(out3))
    assert config3["architecture"] == "eagle3" and config3["feature_layers"] == [0]
    assert sd3["fuse.weight"].shape == (64, 2 * 64)
    assert fused["data"] == manifest["data"]
    assert fused["training"]["l1_weight"] == 0 and fused["training"]["feature_layers"] == (0,)
    first, last = fused["training"]["first_logged"], fused["training"]["last_logged"]
    assert last["loss"] < 0.6 * first["loss"], (first, last)
    stored = features.load_features(str(work), "answers")[0]["features"]
    assert stored.shape[1] == 2 * 64
    # started from the eagle1 head: its manifest is kept as the new head's lineage
    out4 = tmp_path / "head4"
    argv4 = [str(out4) if a == str(out) else a for a in argv]
    # (another split of the data, whose own draft vocabulary would differ: the head's is kept)
    argv4 += ["--feature-layers", "0", "--init-from", str(out), "--heldout-fraction", "0.6"]
    warm = cli.main([*argv4, "--steps", "5"])
    assert warm["training"]["init_from"] == str(out) and warm["training"]["steps"] == 5
    assert warm["init_from_manifest"] == json.loads((out / "manifest.json").read_text())
    assert torch.equal(eagle_format.load_head(str(out4))[0]["d2t"], sd["d2t"])
    train06 = split(features.load_features(str(work), "answers"), 0.6, 0)[0]
    assert not torch.equal(choose_draft_vocab(train06, config["target_vocab_size"], 64), sd["d2t"])
    with pytest.raises(ValueError, match=r"--draft-vocab-size must be 64 .*got 32"):
        cli.main([*argv4, "--draft-vocab-size", "32", "--work-dir", str(tmp_path / "w5")])
    assert not (tmp_path / "w5").exists()  # checked before any stage
    other = tmp_path / "other-target"
    shutil.copytree(out, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"target_vocab_size": 99999}))
    with pytest.raises(ValueError, match=r"head is for a target of 99999 tokens; this model has"):
        cli.main([*argv4, "--init-from", str(other), "--work-dir", str(tmp_path / "w5")])
    assert not (tmp_path / "w5").exists()


def test_feature_layers_are_checked_before_any_stage(tmp_path):
    model = build_tiny_llama(tmp_path / "model")  # 2 layers: only layer 0 may be fused
    argv = ["--model", model, "--out", str(tmp_path / "h"), "--work-dir", str(tmp_path / "w"),
            "--feature-layers", "1"]  # fmt: skip
    with pytest.raises(ValueError, match=r"--feature-layers must be below 1 .*got \[1\]"):
        cli.main(argv)
    assert not (tmp_path / "w").exists()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*argv[:6], "--feature-layers", "1,0"])


def test_feature_files_made_for_other_layers_are_redone(tmp_path):
    """A file without ``feature_layers`` predates fused features: eagle1's, not eagle3's."""
    path = str(tmp_path / "f.safetensors")
    assert not features._has_features(path, ())
    save_file({"features": torch.zeros(2, 4)}, path)
    assert features._has_features(path, ()) and not features._has_features(path, (0,))
    save_file({"features": torch.zeros(2, 8), "feature_layers": torch.tensor([0])}, path)
    assert features._has_features(path, (0,)) and not features._has_features(path, ())
    assert not features._has_features(path, (1,))


def test_an_eagle1_head_starts_an_eagle3_one_where_it_was(tmp_path):
    """--init-from: an eagle3 head initialised from an eagle1 head computes what that head
    computes (fuse starts as the final hidden state alone), whatever the other layer holds."""
    sd, config = tiny_head()
    eagle_format.save_head(str(tmp_path), sd, config)
    layer = eagle_format.layer_config_from_hf(TINY)
    fused = EagleHead(layer, 10, feature_layers=(3,))
    fused.d2t.copy_(sd["d2t"])
    cli._init_head(fused, str(tmp_path))
    plain = EagleHead.from_dir(str(tmp_path))
    emb, final, other = torch.randn(3, 2, 12, 32).unbind(0)
    with torch.no_grad():
        want = plain(emb, final, steps=2)
        got = fused(emb, torch.cat([other, final], dim=-1), steps=2)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    other = EagleHead(layer, 10, feature_layers=(2,))
    other.d2t.copy_(sd["d2t"])
    eagle_format.save_head(str(tmp_path / "fused"), {
        k: v for k, v in fused.state_dict().items()
    }, eagle_format.make_config(layer, 10, TINY.vocab_size, "tiny", (3,)))  # fmt: skip
    with pytest.raises(ValueError, match="reads other target layers"):
        cli._init_head(other, str(tmp_path / "fused"))
    fused.d2t.add_(1)
    with pytest.raises(ValueError, match="draft vocabulary is not this run's"):
        cli._init_head(fused, str(tmp_path))


def test_sampled_accept_is_the_overlap_of_the_tempered_distributions():
    """``sampled_accept`` = mean over trained positions of sum_x min(p(x), q(x)): p the target's
    distribution over its whole vocabulary, q the head's over its draft ids (zero elsewhere),
    both at SAMPLED_TEMPERATURE; computed here in float64."""
    head, emb, feat = _head_and_inputs()
    head.d2t.copy_(torch.arange(10) * 7)
    target_head = torch.randn(TINY.vocab_size, 32)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    batch = {"embeds": emb, "features": feat, "mask": mask, "greedy": torch.zeros(2, dtype=bool),
             "labels": torch.zeros(2, 12, dtype=torch.long),
             "next_tokens": torch.zeros(2, 12, dtype=torch.long)}  # fmt: skip
    got = losses.evaluate(head, [batch], target_head, steps=1)["sampled_accept"]
    t = losses.SAMPLED_TEMPERATURE
    with torch.no_grad():
        h = head(emb, feat, steps=1)[0][mask].double()
        p = torch.softmax(feat[mask].double() @ target_head.double().T / t, -1)
        q = torch.zeros_like(p)
        q[:, head.d2t] = torch.softmax(h @ head.lm_head.weight.double().T / t, -1)
    assert got == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), rel=1e-5)


def test_soft_ce_is_cross_entropy_against_the_targets_distribution():
    """With ``soft_from``, each unrolled step's CE is against softmax(feature @ rows.T) at the
    positions that step trains (step s: positions >= s), checked in float64."""
    head, emb, feat = _head_and_inputs()
    rows = torch.randn(10, 32)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 9:] = False
    batch = {"embeds": emb, "features": feat, "mask": mask,
             "labels": torch.zeros(2, 12, dtype=torch.long)}  # fmt: skip
    _, metrics = losses.head_loss(head, batch, 2, 0.0, 1.0, 0.8, soft_from=rows)
    with torch.no_grad():
        outs = head(emb, feat, steps=2)
        log_q = [torch.log_softmax(head.lm_head(h).double(), -1) for h in outs]
    for s in range(2):
        m = mask & (torch.arange(12) >= s)
        p = torch.softmax(feat[m].double() @ rows.double().T, -1)
        expected = float(-(p * log_q[s][m]).sum(-1).mean())
        assert metrics[f"ce_{s}"] == pytest.approx(expected, rel=1e-5)
