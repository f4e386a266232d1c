"""The benchmark scripts at a tiny size: they run, their JSON holds measured numbers whose derived
figures (ratios, ceilings, targets) follow from them, and the report renders from it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from benchmarks import kernels as kernels_bench
from benchmarks import latency, linear, report, roofline, run_all, spec_decode, throughput
from benchmarks.peers import PEERS
from engine.models import LlamaForCausalLM

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def throughput_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = throughput.build_parser().parse_args(
        [
            "--model",
            tiny_llama,
            "--batch-sizes",
            "1,3",
            "--input-len",
            "8:24",
            "--output-len",
            "3:9",
            "--waves",
            "2",
            "--repeats",
            "2",
            "--output-dir",
            str(out),
            "--tag",
            "tp",
        ]
    )
    throughput.run(args)
    return out, json.loads((out / "tp.json").read_text())


def test_throughput_json_plot_and_ratios(throughput_run, tiny_llama):
    out, payload = throughput_run
    assert (out / "tp.png").read_bytes()[:8] == PNG_MAGIC
    assert [r["batch_size"] for r in payload["results"]] == [1, 3]
    cost = roofline.ModelCost(
        *(payload["model"][k] for k in ("num_params", "weight_bytes", "dtype"))
    )
    rates = roofline.DeviceRates(**payload["roofline"])
    config = AutoConfig.from_pretrained(tiny_llama)
    banned = throughput.special_token_ids(config, AutoTokenizer.from_pretrained(tiny_llama))
    # Same seed, same ranges: the workload the run used, rebuilt.
    workload = throughput.make_workload(6, (8, 24), (3, 9), config.vocab_size, banned, 0)
    for row in payload["results"]:
        b = row["batch_size"]
        requests = workload[: 2 * b]
        assert row["num_requests"] == 2 * b
        assert set(row["systems"]) == {"pagedspec", *PEERS}
        for name, s in row["systems"].items():
            assert "error" not in s, (name, s)
            # Every system made exactly the requested tokens, and the rates follow from them.
            assert s["output_tokens"] == sum(r.output_len for r in requests)
            assert s["input_tokens"] == sum(len(r.prompt_ids) for r in requests)
            assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["elapsed_s"])
            assert 0 < s["ttft_median_s"] <= s["ttft_p99_s"] <= s["elapsed_s"]
            assert 0 < s["tpot_median_s"] <= s["tpot_p99_s"]
            # The fastest of the two timed runs is the one reported.
            assert len(s["output_tokens_per_s_runs"]) == 2
            assert s["output_tokens_per_s"] == max(s["output_tokens_per_s_runs"])
        ours = row["systems"]["pagedspec"]
        for peer in PEERS:
            expected = ours["output_tokens_per_s"] / row["systems"][peer]["output_tokens_per_s"]
            assert row["ratios"][peer] == pytest.approx(expected)
        assert row["ceiling_tokens_per_s"] == pytest.approx(roofline.decode_ceiling(b, cost, rates))
        assert row["roofline_fraction"] == pytest.approx(
            ours["output_tokens_per_s"] / row["ceiling_tokens_per_s"]
        )
        assert 0 < ours["peak_kv_blocks_used"] <= ours["num_kv_blocks"]
        assert ours["preemptions"] == 0  # the run sizes KV so that every request fits
    assert payload["machine"]["cores"] >= 1 and payload["roofline"]["bandwidth_gbs"] > 0


def test_report_renders_throughput(throughput_run, tmp_path):
    out, payload = throughput_run
    text = report.render(out, tmp_path / "RESULTS.md")
    ratio = payload["results"][-1]["ratios"]["hf-static"]
    assert "## Throughput" in text and f"| {ratio:.2f} |" in text
    assert f"]({out.as_posix()}" not in text  # links are relative to RESULTS.md
    assert "tp.png)" in text
    # Batch 1 was measured, batch 32 was not: only the batch-1 target is reported.
    [target] = throughput.targets(payload)
    assert target["value"] == pytest.approx(payload["results"][0]["ratios"]["hf-static"])
    assert target["passed"] == (target["value"] >= 1.5)
    verdict = "PASS" if target["passed"] else "MISS"
    assert f"| {target['name']} | {target['value']:.2f}x | >= 1.5x | **{verdict}** |" in text


def test_linear_benchmark_times_both_paths(tiny_llama, tmp_path):
    args = ["--model", tiny_llama, "--rows", "1,3,300", "--repeats", "2"]
    payload = linear.run(linear.build_parser().parse_args([*args, "--output-dir", str(tmp_path)]))
    assert json.loads((tmp_path / "linear.json").read_text())["results"] == payload["results"]
    assert [r["rows"] for r in payload["results"]] == [1, 3, 300]
    for r in payload["results"]:
        assert r["speedup"] == pytest.approx(r["f_linear_ms"] / r["linear_ms"])
        assert r["linear_gbs"] == pytest.approx(payload["weight_bytes"] / r["linear_ms"] / 1e6)
    text = report.render(tmp_path, tmp_path / "RESULTS.md")
    assert (
        "## Linear layers" in text
        and f"| 300 | {payload['results'][2]['f_linear_ms']:.1f} |" in text
    )


def test_latency_and_spec_decode_smoke(tiny_llama, tmp_path):
    lat = latency.run(
        latency.build_parser().parse_args(
            [
                "--model",
                tiny_llama,
                "--batch-sizes",
                "1,2",
                "--output-len",
                "5",
                "--warmup-iters",
                "1",
                "--iters",
                "2",
                "--output-dir",
                str(tmp_path),
            ]
        )
    )
    assert json.loads((tmp_path / "latency.json").read_text()) == lat
    assert [(r["config"], r["batch_size"]) for r in lat["results"]] == [
        ("no-spec", 1),
        ("no-spec", 2),
        ("ngram-k4", 1),
        ("ngram-k4", 2),
    ]
    for r in lat["results"]:
        assert r["iterations"] == 2
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
        assert r["tpot_s"]["p50"] <= r["batch_latency_s"]["p50"]

    spec = spec_decode.run(
        spec_decode.build_parser().parse_args(
            [
                "--model",
                tiny_llama,
                "--num-prompts",
                "2",
                "--max-tokens",
                "8",
                "--k-values",
                "2",
                "--batch-sizes",
                "1,2",
                "--sweep-max-tokens",
                "6",
                "--output-dir",
                str(tmp_path),
            ]
        )
    )
    assert (tmp_path / "spec_decode.png").read_bytes()[:8] == PNG_MAGIC
    for workload in ("grounded", "open"):
        systems = spec["workloads"][workload]
        assert set(systems["pagedspec"]) == set(systems["hf"]) == {"none", "2"}
        for runs in systems.values():
            for r in runs.values():
                # Greedy speculation is lossless, and HF runs the same weights.
                assert r["same_tokens_as_reference"] == 1.0
                assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert set(spec["batch_sweep"]) == {"grounded", "open"}
    for sweep in spec["batch_sweep"].values():
        rows = sweep["rows"]
        assert sweep["default_vs_off_at_largest"] == pytest.approx(
            rows["default"]["2"]["tokens_per_s"] / rows["off"]["2"]["tokens_per_s"]
        )
        # Lossless at any batch size: the same tokens, so the same count, whatever the config.
        assert rows["off"]["2"]["tokens"] == rows["forced"]["2"]["tokens"]
        assert rows["off"]["2"]["tokens"] == rows["default"]["2"]["tokens"]
    assert len(spec["targets"]) == 4
    for t in spec["targets"]:
        assert t["passed"] == (t["value"] >= t["threshold"])

    text = report.render(tmp_path, tmp_path / "RESULTS.md")
    assert "## Latency" in text and "## Speculative decoding" in text
    for t in spec["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        assert f"| {t['value']:.2f}x | >= {t['threshold']}x | **{verdict}** |" in text


def test_parse_errors_name_the_field():
    assert throughput.parse_range("32:256", "input_len") == (32, 256)
    assert throughput.parse_range("7", "output_len") == (7, 7)
    for bad in ("0:4", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError, match="input_len"):
            throughput.parse_range(bad, "input_len")
    with pytest.raises(ValueError, match="batch_sizes"):
        throughput.parse_int_list("4,0", "batch_sizes")
    assert throughput.parse_int_list("16,1,4,4", "batch_sizes") == [1, 4, 16]


def test_workload_is_seeded_and_avoids_special_ids():
    banned = {0, 1, 2, 5}
    a = throughput.make_workload(50, (4, 40), (2, 9), 8, banned, seed=3)
    assert a == throughput.make_workload(50, (4, 40), (2, 9), 8, banned, seed=3)
    assert a != throughput.make_workload(50, (4, 40), (2, 9), 8, banned, seed=4)
    assert all(4 <= len(r.prompt_ids) <= 40 and 2 <= r.output_len <= 9 for r in a)
    assert {t for r in a for t in r.prompt_ids} == {3, 4, 6, 7}


def test_decode_ceiling_is_the_slower_of_memory_and_compute():
    cost = roofline.ModelCost(num_params=10**9, weight_bytes=2 * 10**9, dtype="bfloat16")
    rates = roofline.DeviceRates(100.0, 1000.0, "cpu", "bfloat16", 1 << 20, 64)
    # Reading 2 GB at 100 GB/s takes 20 ms; B tokens of compute take 2 ms * B.
    assert roofline.decode_ceiling(1, cost, rates) == pytest.approx(1 / 0.02)
    assert roofline.decode_ceiling(10, cost, rates) == pytest.approx(10 / 0.02)
    assert roofline.decode_ceiling(40, cost, rates) == pytest.approx(40 / 0.08)
    with pytest.raises(ValueError, match="batch_size"):
        roofline.decode_ceiling(0, cost, rates)


@pytest.mark.parametrize("tied", [False, True])
def test_model_cost_counts_layers_and_lm_head(tiny_llama, tied):
    config = AutoConfig.from_pretrained(tiny_llama)
    config.tie_word_embeddings = tied
    model = LlamaForCausalLM(config)
    cost = roofline.model_cost(model)
    total = sum(p.numel() for p in model.parameters())  # a tied matrix counted once
    embedding = config.vocab_size * config.hidden_size
    assert cost.num_params == (total if tied else total - embedding)
    assert cost.weight_bytes == 4 * cost.num_params and cost.dtype == "float32"


def test_run_all_commands_pass_the_model_where_taken(tmp_path):
    cmds = run_all.commands(quick=True, model="/m", output_dir=tmp_path)
    takes_model = {"throughput", "latency", "spec_decode", "linear"}
    assert set(cmds) == takes_model | {"block_manager", "kernels"}
    for name, cmd in cmds.items():
        assert cmd[1:3] == ["-m", f"benchmarks.{name}"]
        assert cmd[cmd.index("--output-dir") + 1] == str(tmp_path)
        assert ("--model" in cmd) == (name in takes_model)
    full = run_all.commands(quick=False, model=None, output_dir=tmp_path)
    sizes = full["throughput"][full["throughput"].index("--batch-sizes") + 1]
    assert throughput.parse_int_list(sizes, "batch_sizes") == [1, 4, 16, 32, 64]


def test_cpu_kernel_benchmark_compares_both_backends_and_renders(tmp_path):
    assert (
        kernels_bench.main(["--spans", "1,5", "--iters", "1", "--output-dir", str(tmp_path)]) == 0
    )
    payload = json.loads((tmp_path / "kernels.json").read_text())
    assert [(r["span"], r["backend"]) for r in payload["rows"]] == [
        (1, "torch"),
        (1, "cpu"),
        (5, "torch"),
        (5, "cpu"),
    ]
    assert all(r["median_us"] > 0 for r in payload["rows"])
    assert payload["rows"][1]["speedup_vs_torch"] > 0
    text = report.render(tmp_path, tmp_path / "RESULTS.md")
    assert "C++ kernel (`cpu`) vs gather + SDPA" in text
