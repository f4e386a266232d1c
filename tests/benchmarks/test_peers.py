"""llama.cpp as a peer and the accuracy benchmark, without llama_cpp (CI never builds it): the
precision table, the GGUF file naming, the batched driver's bookkeeping on a fake llama.cpp that
checks every batch, the accuracy metrics on fixed inputs, and pagedspec's teacher-forced NLL
through its ModelRunner against HF transformers."""

import argparse
import dataclasses
import math
import random

import pytest
import torch
from transformers import LlamaForCausalLM

from benchmarks import accuracy, llamacpp, precisions, report, run_all, throughput, workload
from benchmarks.workload import BenchRequest


def test_every_precision_maps_to_a_gguf_type_and_engine_options():
    for name, p in precisions.PRECISIONS.items():
        assert p.name == name and p.gguf_type in llamacpp.FTYPES
    # a 16-bit KV cache both sides: llama.cpp's default F16 KV
    fp32 = precisions.engine_options(precisions.get_precision("fp32"))
    assert fp32 == {"dtype": "float32", "kv_cache_dtype": "float16"}
    assert precisions.engine_options(precisions.get_precision("bf16")) == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"precision must be one of .*'fp8'"):
        precisions.get_precision("fp8")


def test_int8_errors_until_the_engine_has_quantization(monkeypatch):
    int8 = precisions.get_precision("int8")
    fields = {f.name for f in dataclasses.fields(precisions.EngineConfig)}
    if "quantization" not in fields:
        with pytest.raises(ValueError, match=r"quantization='int8'.*does not have"):
            precisions.engine_options(int8)

    @dataclasses.dataclass(frozen=True)
    class WithQuantization:
        dtype: str = "auto"
        quantization: str | None = None
        kv_cache_dtype: str = "auto"

    monkeypatch.setattr(precisions, "EngineConfig", WithQuantization)
    expect = {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "float16"}
    assert precisions.engine_options(int8) == expect


def _throughput_args(*argv: str) -> argparse.Namespace:
    return throughput.build_parser().parse_args(["--device", "cpu", *argv])


def test_throughput_precision_sets_the_dtype_or_follows_it():
    args = _throughput_args("--precision", "bf16")
    assert throughput.pick_precision(args).gguf_type == "F16" and args.dtype == "bfloat16"
    assert throughput.pick_precision(_throughput_args()).name == "fp32"  # CPU auto: float32
    assert throughput.pick_precision(_throughput_args("--dtype", "bfloat16")).name == "bf16"
    assert throughput.pick_precision(_throughput_args("--dtype", "float16")) is None
    with pytest.raises(ValueError, match="--dtype bfloat16 contradicts --precision int8"):
        throughput.pick_precision(_throughput_args("--precision", "int8", "--dtype", "bfloat16"))


def test_gguf_files_are_cached_per_source_and_type(tmp_path):
    paths = {
        t: llamacpp.cached_path("/x/Model.Q4_1.gguf", t, str(tmp_path)) for t in llamacpp.FTYPES
    }
    assert len(set(paths.values())) == len(paths)
    assert paths["Q8_0"] == str(tmp_path / "llamacpp-v1" / "Model.Q4_1" / "Q8_0.gguf")
    with pytest.raises(ValueError, match="gguf_type must be one of"):
        llamacpp.cached_path("/x/Model.Q4_1.gguf", "Q5_K", str(tmp_path))


def test_the_shipped_file_is_used_as_is_at_its_own_type():
    from pagedspec.engine.loader.default_model import default_gguf_path

    assert llamacpp.file_type(default_gguf_path()) == "Q4_1"
    assert llamacpp.gguf_file("Q4_1") == default_gguf_path()  # no quantizer, no llama_cpp


def test_llamacpp_needs_gguf_weights(tiny_llama):
    spec = workload.resolve_model(tiny_llama, "auto", None)
    with pytest.raises(ValueError, match="needs GGUF weights"):
        llamacpp.source_gguf(spec)
    assert llamacpp.source_gguf(spec._replace(engine_model=None)) is None


class FakeLlama:
    """llama.cpp's side of ``run_batched``: per sequence id a KV list of (position, token); the
    next token is a function of the sequence's whole KV, so a token fed to the wrong sequence,
    at the wrong position or twice changes every later output. Checks each batch as
    llama_decode would (sizes, contiguous positions, ids in range)."""

    VOCAB = 97

    def __init__(self, n_batch: int, n_seq_max: int):
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.kv: dict[int, list[tuple[int, int]]] = {}
        self.batches: list[list[tuple]] = []
        self.cleared: list[int] = []

    @classmethod
    def next_token(cls, tokens: list[int]) -> int:
        return sum((i + 1) * t for i, t in enumerate(tokens)) * 31 % cls.VOCAB

    def decode(self, tokens, positions, seq_ids, outputs):
        assert 0 < len(tokens) <= self.n_batch
        self.batches.append(list(zip(tokens, positions, seq_ids, outputs, strict=True)))
        rows = []
        for t, p, s, o in self.batches[-1]:
            assert 0 <= s < self.n_seq_max
            kv = self.kv.setdefault(s, [])
            assert p == len(kv), f"sequence {s}: position {p} after {len(kv)} tokens"
            kv.append((p, t))
            if o:
                row = torch.zeros(self.VOCAB)
                row[self.next_token([tok for _, tok in kv])] = 1.0
                rows.append(row)
        return torch.stack(rows).numpy() if rows else torch.zeros(0, self.VOCAB).numpy()

    def clear(self, seq_id: int) -> None:
        self.cleared.append(seq_id)
        del self.kv[seq_id]


def _alone(prompt: list[int], n: int) -> list[int]:
    """The greedy continuation a request gets on its own."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(FakeLlama.next_token(seq))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("batch_size,n_batch", [(1, 64), (3, 64), (8, 64), (4, 8)])
def test_batched_driver_gives_each_request_its_own_greedy_tokens(batch_size, n_batch):
    rng = random.Random(batch_size)
    requests = [BenchRequest([rng.randrange(97) for _ in range(rng.randint(1, 20))],
                             rng.randint(1, 9)) for _ in range(8)]  # fmt: skip
    fake, ticks = FakeLlama(n_batch, batch_size), iter(range(10**6))
    timings, tokens = llamacpp.run_batched(fake, requests, batch_size, clock=lambda: next(ticks))
    assert tokens == [_alone(r.prompt_ids, r.output_len) for r in requests]
    for t, r in zip(timings, requests, strict=True):
        assert t.num_output_tokens == r.output_len and 0 < t.first_token_s <= t.last_token_s
    assert fake.kv == {} and len(fake.cleared) == len(requests)  # every sequence freed
    # Running sequences decode in every batch; a prompt's logits come only at its last token.
    asked = sum(o for b in fake.batches for *_, o in b)
    assert asked == sum(r.output_len for r in requests)
    if batch_size == 8:  # everyone at once: one step per token of the longest request
        assert len(fake.batches) == max(r.output_len for r in requests)


def test_batched_driver_refuses_more_sequences_than_a_batch_holds():
    with pytest.raises(ValueError, match=r"batch_size must be in 1..n_batch \(4\), got 5"):
        llamacpp.run_batched(FakeLlama(4, 5), [BenchRequest([1], 1)], 5)
    for bad in (BenchRequest([], 3), BenchRequest([1], 0)):  # would never finish
        with pytest.raises(ValueError, match="request 1: prompt_ids must be non-empty"):
            llamacpp.run_batched(FakeLlama(4, 4), [BenchRequest([1], 1), bad], 2)


def test_agreement_and_perplexity_on_fixed_inputs():
    assert accuracy.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accuracy.common_prefix([], [1]) == 0
    scores = accuracy.greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert scores == {"identical": 0.5, "mean_common_prefix": 2.0, "tokens_per_output": 3.0,
                      "common_prefixes": [3, 1]}  # fmt: skip
    with pytest.raises(ValueError, match="as many outputs as references"):
        accuracy.greedy_agreement([[1]], [])
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]], dtype=torch.float64)  # p = 1/4, 3/4
    nll = accuracy.token_nll(logits, [1, 0])
    assert nll.dtype == torch.float64
    assert nll.tolist() == pytest.approx([-math.log(0.75), math.log(2.0)], abs=1e-12)
    assert accuracy.perplexity(torch.tensor([math.log(7.0)] * 3)) == pytest.approx(7.0)
    assert accuracy.perplexity(accuracy.token_nll(torch.zeros(5, 11), [3] * 5)) == pytest.approx(11)
    assert accuracy.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert accuracy.windows(list(range(9)), 4)[-1] == [4, 5, 6, 7]  # a 1-token tail scores nothing


def test_teacher_forced_nll_through_the_runner_equals_hf(tiny_llama, monkeypatch):
    monkeypatch.setattr(accuracy, "CHUNK", 7)  # windows of 20 cross chunk and block borders
    spec = workload.resolve_model(tiny_llama, "auto", None)
    args = argparse.Namespace(dtype="float32", device="cpu", attention_backend="auto", seed=0,
                              window=20)  # fmt: skip
    rng = random.Random(0)
    chunks = accuracy.windows([rng.randrange(3, 512) for _ in range(45)], 20)
    requests = [BenchRequest([5, 6, 7], 4)]
    side = accuracy.pagedspec_side(spec, args, {"dtype": "float32"}, requests, chunks)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [accuracy.token_nll(hf(torch.tensor([w])).logits[0, :-1], w[1:]) for w in chunks]
    assert side["nll"].shape == (sum(len(w) - 1 for w in chunks),)
    torch.testing.assert_close(side["nll"], torch.cat(want), atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False,
                             eos_token_id=None, min_new_tokens=4)[0, 3:].tolist()  # fmt: skip
    assert side["tokens"] == [greedy]


def test_report_renders_accuracy_and_llamacpp_targets():
    row = lambda p, g: {"precision": p, "note": "n", "pagedspec_options": "dtype=float32",
                        "gguf_type": g, "pagedspec": {"identical": 0.9, "mean_common_prefix": 60.0,
                        "perplexity": 12.5, "tokens_per_output": 64.0},
                        "llamacpp": {"error": "llama_cpp is not importable"}}  # fmt: skip
    machine = {"cpu": "cpu", "cores": 2, "torch_threads": 2, "command": "c", "torch": "t",
               "transformers": "t", "python": "3", "git_commit": "abc", "gpu": None}  # fmt: skip
    acc = {"benchmark": "accuracy", "machine": machine, "model": "m", "config": {"window": 512},
           "text": {"file": "a.txt", "tokens": 100, "windows": 1, "scored_tokens": 99},
           "prompts": {"num": 10, "max_tokens": 64}, "llamacpp": {"version": "0.3.36"},
           "rows": [row("fp32", "F32")]}  # fmt: skip
    text = report.section(acc, "accuracy.json")
    assert "| fp32 | dtype=float32 | 90% | 60.0 | 12.500 | F32 | unavailable: llama_cpp" in text
    for name, least in (("fp32", 1.0), ("q4_1", None)):
        tp = {"benchmark": "throughput", "precision": {"name": name, "gguf_type": "X"},
              "results": [{"batch_size": 1, "ratios": {"llamacpp": 0.8}},
                          {"batch_size": 32, "ratios": {"llamacpp": 2.5}}]}  # fmt: skip
        found = {t["name"]: (t["value"], t["threshold"]) for t in report.targets(tp)}
        expected = {
            f"throughput, batch 1: pagedspec {name} vs llama.cpp X": (0.8, 1.0),
            f"throughput, batch 32: pagedspec {name} vs llama.cpp X": (2.5, 2.0),
        }
        assert found == (expected if least else {})  # Q4_1 as shipped has no target
    # With a run ceiling, the ceiling over the peer's tokens/s.
    llama = {"llamacpp": {"output_tokens_per_s": 200.0}}
    tp["precision"]["name"] = "fp32"
    tp["results"][1] |= {"run_ceiling_tokens_per_s": 370.0, "systems": llama}
    bounds = [t["bound"] for t in report.targets(tp)]
    assert bounds == [None, pytest.approx(1.85)]


def test_run_all_adds_llamacpp_runs_only_where_it_imports(monkeypatch):
    monkeypatch.setattr(llamacpp, "unavailable_reason", lambda: "not built")
    assert run_all.peer_commands() == {}
    monkeypatch.setattr(llamacpp, "unavailable_reason", lambda: None)
    peers = run_all.peer_commands()
    assert peers and all(name.startswith("throughput-llamacpp-") for name in peers)
    for name, (module, *flags) in peers.items():
        args = throughput.build_parser().parse_args(flags)
        assert module == "throughput" and args.peers == ["llamacpp"] and args.tag == name
        precisions.engine_options(precisions.get_precision(args.precision))  # runnable here


def test_throughput_skips_llamacpp_with_its_reason(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(llamacpp, "unavailable_reason", lambda: "llama_cpp is not importable")
    argv = ["--model", tiny_llama, "--batch-sizes", "2", "--input-len", "4", "--output-len", "3"]
    argv += ["--repeats", "1", "--peers", "llamacpp", "--output-dir", str(tmp_path)]
    payload = throughput.run(_throughput_args(*argv))
    assert payload["skipped_peers"] == {"llamacpp": "llama_cpp is not importable"}
    assert "skipping peer llamacpp: llama_cpp is not importable" in capsys.readouterr().out
    assert set(payload["results"][0]["systems"]) == {"pagedspec"}
    assert payload["precision"]["gguf_type"] == "F32"
    assert "- llamacpp skipped: llama_cpp is not importable" in report.section(payload, "t.json")
