"""Regenerates benchmarks/RESULTS.md from the JSON files the benchmarks wrote: every number in it
comes from those files, and every PASS/MISS is computed from them.

    python -m benchmarks.report [--results-dir benchmarks/results] [--output benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import spec_decode, throughput


def _load(results_dir: Path) -> dict[str, list[dict]]:
    """JSON payloads by benchmark name (block_manager.json carries no name: its file says it)."""
    found: dict[str, list[dict]] = {}
    for path in sorted(results_dir.glob("*.json")):
        payload = json.loads(path.read_text())
        name = payload.get("benchmark") or path.stem
        payload["_file"] = path.name
        found.setdefault(name, []).append(payload)
    return found


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _machine(payload: dict) -> list[str]:
    m = payload["machine"]
    device = m["gpu"] or f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads"
    return [
        f"- command: `{m['command']}`",
        f"- machine: {device}; torch {m['torch']}, transformers {m['transformers']}, "
        f"python {m['python']}; commit {m['git_commit']}"
        + (f"; run {m['date']}" if m.get("date") else ""),
        f"- raw numbers: [{payload['_file']}]({{results}}/{payload['_file']})",
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render_throughput(p: dict) -> list[str]:
    model, rates = p["model"], p["roofline"]
    cfg = p["config"]
    weights = "dummy" if model["load_format"] == "dummy" else "checkpoint"
    title = f"{model['name']} ({model['dtype']}, {weights} weights)"
    lines = [f"## Throughput: {title}", ""]
    lines += _machine(p)
    lines += [
        f"- workload: per batch size B, {cfg['waves']} x B requests submitted at once, "
        f"input {cfg['input_len']} tokens, output {cfg['output_len']} tokens (uniform, seed "
        f"{cfg['seed']}), greedy, ignore_eos; speculation: {cfg['speculative_method'] or 'off'}",
        f"- each system's fastest of {cfg.get('repeats', 1)} timed runs (the systems take turns; "
        "pagedspec from a fresh engine each run, so no run hits the prefix cache)",
        f"- weights: {p['weights_note']}",
        f"- measured ceilings: copy {rates['bandwidth_gbs']:.1f} GB/s, {rates['dtype']} GEMM "
        f"{rates['matmul_gflops']:.1f} GFLOP/s; model {model['num_params'] / 1e6:.1f} M matmul "
        f"parameters (layers + LM head), {model['weight_bytes'] / 1e6:.0f} MB read per decode step",
        "",
    ]
    rows = []
    for r in p["results"]:
        for name, s in r["systems"].items():
            if "error" in s:
                rows.append([str(r["batch_size"]), name, f"unavailable: {s['error']}"] + [""] * 7)
                continue
            ratio = r["ratios"].get(name)
            ours = name == "pagedspec"
            rows.append(
                [
                    str(r["batch_size"]),
                    name,
                    f"{s['output_tokens_per_s']:.1f}",
                    f"{s['total_tokens_per_s']:.1f}",
                    f"{s['requests_per_s']:.2f}",
                    f"{_ms(s['ttft_median_s'])} / {_ms(s['ttft_p99_s'])}",
                    f"{_ms(s['tpot_median_s'])} / {_ms(s['tpot_p99_s'])}",
                    "" if ratio is None else f"{ratio:.2f}",
                    f"{r['ceiling_tokens_per_s']:.0f}" if ours else "",
                    f"{r['roofline_fraction']:.1%}" if ours else "",
                ]
            )
    lines += _table(
        [
            "B",
            "system",
            "out tok/s",
            "total tok/s",
            "req/s",
            "TTFT p50 / p99 ms",
            "TPOT p50 / p99 ms",
            "pagedspec / peer",
            "decode ceiling tok/s",
            "of ceiling",
        ],
        rows,
    )
    ours = [r["systems"]["pagedspec"] for r in p["results"]]
    lines += [
        "",
        "pagedspec peak KV blocks used / allocated: "
        + ", ".join(
            f"B={r['batch_size']}: {s['peak_kv_blocks_used']}/{s['num_kv_blocks']}"
            for r, s in zip(p["results"], ours, strict=True)
        )
        + f"; preemptions: {sum(s['preemptions'] for s in ours)}.",
        "The ceiling bounds decode alone; the fraction divides generated tokens/s, whose time "
        "includes prefill, by it.",
        "",
        f"![throughput]({{results}}/{p['plot']})",
        "",
    ]
    return lines


def render_latency(p: dict) -> list[str]:
    cfg = p["config"]
    lines = [f"## Latency: {p['model']}", ""] + _machine(p)
    lines += [
        f"- workload: grounded chat prompts, {cfg['output_len']} output tokens each (ignore_eos), "
        f"{cfg['warmup_iters']} warm-up + {cfg['iters']} measured iterations per row",
        "",
    ]

    def q(stat: dict) -> str:
        return " / ".join(_ms(stat[k]) for k in ("p50", "p90", "p99"))

    rows = [
        [
            r["config"],
            str(r["batch_size"]),
            q(r["ttft_s"]),
            q(r["tpot_s"]),
            q(r["batch_latency_s"]),
            "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}",
        ]
        for r in p["results"]
    ]
    lines += _table(
        ["config", "B", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "batch ms", "acceptance"],
        rows,
    )
    return [*lines, ""]


def render_spec_decode(p: dict) -> list[str]:
    cfg = p["config"]
    lines = [f"## Speculative decoding: {p['model']}", ""] + _machine(p)
    lines += [
        f"- batch 1, greedy, up to {cfg['max_tokens']} tokens (stop at EOS), "
        f"{cfg['num_prompts']} prompts per workload; 'same tokens' is the share of prompts "
        "whose output equals pagedspec's without speculation",
        "",
    ]
    rows = []
    for workload, systems in p["workloads"].items():
        for system, runs in systems.items():
            base = runs["none"]["tokens_per_s"]
            for k, r in runs.items():
                acc = r.get("acceptance_rate")
                method = "pagedspec" if system == "pagedspec" else "HF generate"
                label = "no speculation" if k == "none" else f"k={k}"
                if k != "none":
                    label = f"{'ngram' if system == 'pagedspec' else 'prompt lookup'} {label}"
                rows.append(
                    [
                        workload,
                        method,
                        label,
                        f"{r['tokens_per_s']:.1f}",
                        f"{r['tokens_per_s'] / base:.2f}",
                        "" if acc is None else f"{acc:.0%}",
                        "" if acc is None else f"{r['mean_accepted_length']:.2f}",
                        f"{r['same_tokens_as_reference']:.0%}",
                    ]
                )
    lines += _table(
        [
            "workload",
            "system",
            "speculation",
            "tok/s",
            "speedup",
            "acceptance",
            "tokens/round",
            "same tokens",
        ],
        rows,
    )
    for workload, sweep in p["batch_sweep"].items():
        lines += _render_sweep(workload, sweep)
    return [*lines, "", f"![speedup vs k]({{results}}/{p['plot']})", ""]


def _render_sweep(workload: str, sweep: dict) -> list[str]:
    rows = []
    for b, off_row in sweep["rows"]["off"].items():
        off = off_row["tokens_per_s"]
        forced = sweep["rows"]["forced"][b]
        default = sweep["rows"]["default"].get(b)
        acc = forced["acceptance_rate"]
        rows.append(
            [
                b,
                f"{off:.1f}",
                f"{forced['tokens_per_s']:.1f}",
                f"{forced['tokens_per_s'] / off:.2f}",
                "" if acc is None else f"{acc:.0%}",
                "" if default is None else f"{default['tokens_per_s']:.1f}",
            ]
        )
    crossover = sweep["crossover_batch_size"]
    lines = [
        "",
        f"Batch sweep, {workload} prompts: up to {sweep['max_tokens']} tokens, ngram "
        f"k={sweep['k']} forced on at every batch size vs off; 'default' is the engine's "
        "SpeculativeConfig "
        f"(speculation off at >= {sweep['default_disable_batch_size']} running or waiting "
        "sequences)"
        + (
            f"; the configs take turns, best of {sweep['repeats']} runs each."
            if sweep.get("repeats")
            else "."
        ),
        "",
    ]
    lines += _table(
        ["B", "off tok/s", "forced tok/s", "forced / off", "acceptance", "default tok/s"], rows
    )
    lines += [
        "",
        "Measured crossover: "
        + (
            f"forced speculation is first slower than none at B={crossover}."
            if crossover
            else "forced speculation was never slower than none up to "
            f"B={sweep['largest_batch_size']}."
        ),
    ]
    return lines


def render_block_manager(p: dict) -> list[str]:
    cfg = p["config"]
    lines = [
        "## KV block manager bookkeeping",
        "",
        "- config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) + f"; python {p['python']}",
        f"- raw numbers: [{p['_file']}]({{results}}/{p['_file']})",
        f"- µs per step for {cfg['num_seqs']} sequences, 1 + {cfg['lookahead']} slots each, "
        f"block size {cfg['block_size']} (append, slot ids, truncate, commit)",
        "",
    ]
    phases = ("append", "slot_ids", "truncate", "commit")
    rows = [
        ["on" if r["prefix_caching"] else "off"]
        + [f"{r[k]:.1f}" for k in ("median_us", "p90_us", "p99_us")]
        + [f"{r[f'{ph}_us']:.1f}" for ph in phases]
        for r in p["results"]
    ]
    lines += _table(["prefix cache", "median", "p90", "p99", *phases], rows)
    return [*lines, ""]


def render_targets(found: dict[str, list[dict]]) -> list[str]:
    measured = [t for p in found.get("throughput", []) for t in throughput.targets(p)]
    measured += [t for p in found.get("spec_decode", []) for t in spec_decode.targets(p)]
    rows = [
        [t["name"], f"{t['value']:.2f}x", f">= {t['threshold']}x",
         "**PASS**" if t["passed"] else "**MISS**"]
        for t in measured
    ]  # fmt: skip
    if not rows:
        return []
    return ["## Targets", "", *_table(["target", "measured", "threshold", ""], rows), ""]


def render_linear(p: dict) -> list[str]:
    lines = [
        f"## Linear layers: pagedspec `Linear` (split GEMV, packed C++ GEMM) vs `F.linear` "
        f"({p['model']})",
        "",
        *_machine(p),
        f"- one pass = every projection of every layer plus the LM head "
        f"({p['weight_bytes'] / 1e6:.0f} MB of weights), median of {p['repeats']} alternated "
        f"passes, {p['threads']} threads",
        "",
    ]
    rows = [
        [str(r["rows"]), f"{r['f_linear_ms']:.1f}", f"{r['linear_ms']:.1f}",
         f"{r['speedup']:.2f}x", f"{r['linear_gbs']:.1f}", f"{r['linear_gflops']:.0f}"]
        for r in p["results"]
    ]  # fmt: skip
    header = ["rows", "F.linear ms", "Linear ms", "speedup", "Linear GB/s", "Linear GFLOP/s"]
    return [*lines, *_table(header, rows), ""]


def render_kernels(p: dict) -> list[str]:
    if p.get("device") != "cpu":
        return []  # the GPU run has its own page (benchmarks/gpu_check.sh)
    shape = ", ".join(f"{k}={v}" for k, v in p["shape"].items())
    lines = [
        "## Paged attention on the CPU: C++ kernel (`cpu`) vs gather + SDPA (`torch`)",
        "",
        *_machine(p),
        f"- one call = one layer; {shape}; batch 64, contexts uniform in 100..1000; "
        f"{p['threads']} threads",
        "",
    ]
    rows = [
        [str(r["span"]), r["backend"], f"{r['median_us']:.0f}", f"{r['gb_per_s']:.1f}",
         f"{r['ms_per_step_30_layers']:.1f}",
         f"{r['speedup_vs_torch']:.2f}x" if "speedup_vs_torch" in r else ""]
        for r in p["rows"]
    ]  # fmt: skip
    header = ["span", "backend", "median µs", "K/V GB/s", "ms per 30 layers", "vs torch"]
    return [*lines, *_table(header, rows), ""]


def render_run_all(p: dict) -> list[str]:
    kind = "quick run" if p["quick"] else "full CPU sweep"
    when = f", started {p['started']}" if p.get("started") else ""
    lines = [
        f"## Run: `python -m benchmarks.run_all` ({kind}, {p['total_s'] / 60:.1f} min{when})",
        "",
    ]
    rows = [
        [r["name"], f"{r['seconds']:.0f}", str(r["returncode"]), f"`{r['command']}`"]
        for r in p["runs"]
    ]
    return [*lines, *_table(["benchmark", "seconds", "exit", "command"], rows), ""]


RENDERERS = {
    "throughput": render_throughput,
    "latency": render_latency,
    "spec_decode": render_spec_decode,
    "block_manager": render_block_manager,
    "linear": render_linear,
    "kernels": render_kernels,
    "run_all": render_run_all,
}


def render(results_dir: Path, output: Path) -> str:
    """RESULTS.md's text for the JSON files in ``results_dir``, with links relative to
    ``output``'s folder."""
    found = _load(results_dir)
    if not found:
        raise ValueError(f"no benchmark JSON files in {results_dir}")
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.report` from the JSON files in "
        f"`{results_dir}`; do not edit by hand. `make bench` reruns the CPU sweep "
        "(`python -m benchmarks.run_all`) and regenerates this page.",
        "",
    ]
    lines += render_targets(found)
    for name, renderer in RENDERERS.items():
        for payload in found.get(name, []):
            lines += renderer(payload)
    link = os.path.relpath(results_dir, output.parent)
    return "\n".join(lines).replace("{results}", Path(link).as_posix()) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--output", type=Path, default=Path("benchmarks/RESULTS.md"))
    args = parser.parse_args()
    args.output.write_text(render(args.results_dir, args.output))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
