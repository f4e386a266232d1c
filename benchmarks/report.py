"""Regenerates benchmarks/RESULTS.md from the JSON files the benchmarks wrote: every number in it
comes from those files, and every PASS/MISS is computed from them here.

    python -m benchmarks.report [--results-dir benchmarks/results] [--output benchmarks/RESULTS.md]
"""

import argparse
import json
import os
import string
from pathlib import Path

# Issue 4's CPU targets: (batch size, peer, minimum pagedspec / peer generated tokens/s).
THROUGHPUT_TARGETS = ((1, "hf-static", 1.5), (32, "hf-static", 2.0), (32, "hf-batch", 3.0))
# Speculation targets on the development CPU. Grounded workload: the best ngram k against no
# speculation and against HF's best prompt-lookup k; the sweep's largest batch: the engine default
# against no speculation.
SPEC_VS_OURS, SPEC_VS_HF_LOOKUP, SPEC_LARGE_BATCH = 1.8, 1.2, 0.95


class _Cells(string.Formatter):
    """str.format for table rows: a missing or None value renders as an empty cell; the spec "ms"
    shows seconds in milliseconds, and a float spec with an "x" after it (".2fx") a ratio."""

    def get_value(self, key: int | str, args: tuple, kwargs: dict) -> object:
        return kwargs.get(key) if isinstance(key, str) else args[key]

    def format_field(self, value: object, spec: str) -> str:
        if value is None:
            return ""
        if spec == "ms":
            return f"{value * 1e3:.1f}"
        return format(value, spec[:-1]) + "x" if spec.endswith("fx") else format(value, spec)


def _row(template: str, *args: object, **kwargs: object) -> str:
    return "| " + _Cells().format(template, *args, **kwargs) + " |"


def _table(header: str, rows: list[str]) -> list[str]:
    """A markdown table; ``header`` holds the column names separated by " | "."""
    return [f"| {header} |", "|" + "---|" * (header.count(" | ") + 1), *rows]


def _section(title: str, notes: list[str], header: str, rows: list[str]) -> list[str]:
    """A section of the page: its title, notes (a bulleted list) and table."""
    return [f"## {title}", "", *notes, *([""] if notes else []), *_table(header, rows), ""]


def _machine(p: dict) -> list[str]:
    m = p["machine"]
    device = m["gpu"] or f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads"
    return [
        f"- command: `{m['command']}`",
        f"- machine: {device}; torch {m['torch']}, transformers {m['transformers']}, "
        f"python {m['python']}; commit {m['git_commit']}"
        + (f"; run {m['date']}" if m.get("date") else ""),
        f"- raw numbers: [{p['_file']}]({{results}}/{p['_file']})",
    ]


def render_throughput(p: dict) -> list[str]:
    model, rates, cfg = p["model"], p["roofline"], p["config"]
    weights = "dummy" if model["load_format"] == "dummy" else "checkpoint"
    template = (
        "{b} | {n} | {s[output_tokens_per_s]:.1f} | {s[total_tokens_per_s]:.1f} | "
        "{s[requests_per_s]:.2f} | {s[ttft_median_s]:ms} / {s[ttft_p99_s]:ms} | "
        "{s[tpot_median_s]:ms} / {s[tpot_p99_s]:ms} | {ratio:.2f} | {ceiling:.0f} | {share:.1%}"
    )
    rows = []
    for r in p["results"]:
        for n, s in r["systems"].items():
            if "error" in s:
                error = "{} | {} | unavailable: {} |  |  |  |  |  |  | "
                rows.append(_row(error, r["batch_size"], n, s["error"]))
                continue
            ours = n == "pagedspec"
            ceiling = {"ceiling": r["ceiling_tokens_per_s"], "share": r["roofline_fraction"]}
            row = {"b": r["batch_size"], "n": n, "s": s, "ratio": r["ratios"].get(n)}
            rows.append(_row(template, **row, **(ceiling if ours else {})))
    used = [(r["batch_size"], r["systems"]["pagedspec"]) for r in p["results"]]
    return [
        f"## Throughput: {model['name']} ({model['dtype']}, {weights} weights)",
        "",
        *_machine(p),
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
        *_table(
            "B | system | out tok/s | total tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
            "| pagedspec / peer | decode ceiling tok/s | of ceiling",
            rows,
        ),
        "",
        "pagedspec peak KV blocks used / allocated: "
        + ", ".join(f"B={b}: {s['peak_kv_blocks_used']}/{s['num_kv_blocks']}" for b, s in used)
        + f"; preemptions: {sum(s['preemptions'] for _, s in used)}.",
        "The ceiling bounds decode alone; the fraction divides generated tokens/s, whose time "
        "includes prefill, by it.",
        "",
        f"![throughput]({{results}}/{p['plot']})",
        "",
    ]


def render_latency(p: dict) -> list[str]:
    cfg = p["config"]
    q = " | ".join(
        f"{{{key}[p50]:ms}} / {{{key}[p90]:ms}} / {{{key}[p99]:ms}}"
        for key in ("ttft_s", "tpot_s", "batch_latency_s")
    )
    rows = [
        _row(f"{{config}} | {{batch_size}} | {q} | {{acceptance_rate:.0%}}", **r)
        for r in p["results"]
    ]
    notes = [
        *_machine(p),
        f"- workload: grounded chat prompts, {cfg['output_len']} output tokens each (ignore_eos), "
        f"{cfg['warmup_iters']} warm-up + {cfg['iters']} measured iterations per row",
    ]
    header = "config | B | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | batch ms | acceptance"
    return _section(f"Latency: {p['model']}", notes, header, rows)


def render_spec_decode(p: dict) -> list[str]:
    cfg, rows = p["config"], []
    template = (
        "{w} | {system} | {label} | {r[tokens_per_s]:.1f} | {speedup:.2f} | "
        "{acc:.0%} | {tokens_per_round:.2f} | {r[same_tokens_as_reference]:.0%}"
    )
    for w, systems in p["workloads"].items():
        for system, runs in systems.items():
            ours = system == "pagedspec"
            for k, r in runs.items():
                label = f"{'ngram' if ours else 'prompt lookup'} k={k}"
                rows.append(_row(
                    template, w=w, r=r, system="pagedspec" if ours else "HF generate",
                    label="no speculation" if k == "none" else label,
                    speedup=r["tokens_per_s"] / runs["none"]["tokens_per_s"],
                    acc=r.get("acceptance_rate"), tokens_per_round=r.get("mean_accepted_length"),
                ))  # fmt: skip
    lines = [
        f"## Speculative decoding: {p['model']}",
        "",
        *_machine(p),
        f"- batch 1, greedy, up to {cfg['max_tokens']} tokens (stop at EOS), "
        f"{cfg['num_prompts']} prompts per workload; 'same tokens' is the share of prompts "
        "whose output equals pagedspec's without speculation",
        "",
        *_table(
            "workload | system | speculation | tok/s | speedup | acceptance | tokens/round "
            "| same tokens",
            rows,
        ),
    ]
    for workload, sweep in p["batch_sweep"].items():
        lines += _render_sweep(workload, sweep)
    return [*lines, "", f"![speedup vs k]({{results}}/{p['plot']})", ""]


def _render_sweep(workload: str, sweep: dict) -> list[str]:
    template = "{b} | {off:.1f} | {forced:.1f} | {ratio:.2f} | {acc:.0%} | {default:.1f}"
    rows = []
    for b, off in sweep["rows"]["off"].items():
        forced, default = sweep["rows"]["forced"][b], sweep["rows"]["default"].get(b, {})
        rows.append(_row(
            template, b=b, off=off["tokens_per_s"], forced=forced["tokens_per_s"],
            ratio=forced["tokens_per_s"] / off["tokens_per_s"], acc=forced["acceptance_rate"],
            default=default.get("tokens_per_s"),
        ))  # fmt: skip
    crossover, repeats = sweep["crossover_batch_size"], sweep.get("repeats")
    return [
        "",
        f"Batch sweep, {workload} prompts: up to {sweep['max_tokens']} tokens, ngram "
        f"k={sweep['k']} forced on at every batch size vs off; 'default' is the engine's "
        f"SpeculativeConfig (speculation off at >= {sweep['default_disable_batch_size']} running "
        "or waiting sequences)"
        + (f"; the configs take turns, best of {repeats} runs each." if repeats else "."),
        "",
        *_table("B | off tok/s | forced tok/s | forced / off | acceptance | default tok/s", rows),
        "",
        f"Measured crossover: forced speculation is first slower than none at B={crossover}."
        if crossover
        else "Measured crossover: forced speculation was never slower than none up to "
        f"B={sweep['largest_batch_size']}.",
    ]


def render_block_manager(p: dict) -> list[str]:
    cfg, us = p["config"], ("median", "p90", "p99", "append", "slot_ids", "truncate", "commit")
    template = "{on} | " + " | ".join(f"{{r[{k}_us]:.1f}}" for k in us)
    rows = [_row(template, on="on" if r["prefix_caching"] else "off", r=r) for r in p["results"]]
    notes = [
        "- config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) + f"; python {p['python']}",
        f"- raw numbers: [{p['_file']}]({{results}}/{p['_file']})",
        f"- µs per step for {cfg['num_seqs']} sequences, 1 + {cfg['lookahead']} slots each, "
        f"block size {cfg['block_size']} (append, slot ids, truncate, commit)",
    ]
    header = "prefix cache | " + " | ".join(us)
    return _section("KV block manager bookkeeping", notes, header, rows)


def render_linear(p: dict) -> list[str]:
    template = "{rows} | {f_linear_ms:.1f} | {linear_ms:.1f} | {speedup:.2fx} | {linear_gbs:.1f}"
    rows = [_row(template + " | {linear_gflops:.0f}", **r) for r in p["results"]]
    notes = [
        *_machine(p),
        f"- one pass = every projection of every layer plus the LM head "
        f"({p['weight_bytes'] / 1e6:.0f} MB of weights), median of {p['repeats']} alternated "
        f"passes, {p['threads']} threads",
    ]
    title = "Linear layers: pagedspec `Linear` (split GEMV, packed C++ GEMM) vs `F.linear`"
    header = "rows | F.linear ms | Linear ms | speedup | Linear GB/s | Linear GFLOP/s"
    return _section(f"{title} ({p['model']})", notes, header, rows)


def render_kernels(p: dict) -> list[str]:
    if p.get("device") != "cpu":
        return []  # the GPU run has its own page (benchmarks/gpu_check.sh)
    template = "{span} | {backend} | {median_us:.0f} | {gb_per_s:.1f} | "
    template += "{ms_per_step_30_layers:.1f} | {speedup_vs_torch:.2fx}"
    notes = [
        *_machine(p),
        f"- one call = one layer; {', '.join(f'{k}={v}' for k, v in p['shape'].items())}; "
        f"batch {'/'.join(sorted({str(r['batch']) for r in p['rows']}))}, contexts uniform in "
        f"100..1000; {p['threads']} threads",
    ]
    title = "Paged attention on the CPU: C++ kernel (`cpu`) vs gather + SDPA (`torch`)"
    header = "span | backend | median µs | K/V GB/s | ms per 30 layers | vs torch"
    return _section(title, notes, header, [_row(template, **r) for r in p["rows"]])


def render_run_all(p: dict) -> list[str]:
    kind = "quick run" if p["quick"] else "full CPU sweep"
    when = f", started {p['started']}" if p.get("started") else ""
    rows = [_row("{name} | {seconds:.0f} | {returncode} | `{command}`", **r) for r in p["runs"]]
    title = f"Run: `python -m benchmarks.run_all` ({kind}, {p['total_s'] / 60:.1f} min{when})"
    return _section(title, [], "benchmark | seconds | exit | command", rows)


RENDERERS = {
    "throughput": render_throughput,
    "latency": render_latency,
    "spec_decode": render_spec_decode,
    "block_manager": render_block_manager,
    "linear": render_linear,
    "kernels": render_kernels,
    "run_all": render_run_all,
}


def targets(p: dict) -> list[dict]:
    """The targets ``p``'s benchmark measured: name, value, threshold and whether it passed."""
    found = []  # (name, value, threshold)
    if p["benchmark"] == "throughput":
        ratios = {r["batch_size"]: r["ratios"] for r in p["results"]}
        for b, peer, least in THROUGHPUT_TARGETS:
            if peer in ratios.get(b, {}):
                name = f"throughput, batch {b}: pagedspec vs {peer}"
                found.append((name, ratios[b][peer], least))
    grounded = p["workloads"].get("grounded") if p["benchmark"] == "spec_decode" else None
    if grounded:
        # The fastest k's tokens/s and its k.
        best = lambda runs: max((r["tokens_per_s"], k) for k, r in runs.items() if k != "none")  # noqa: E731
        ours, k = best(grounded["pagedspec"])
        name = f"grounded: ngram (best k={k}) vs pagedspec without speculation"
        found.append((name, ours / grounded["pagedspec"]["none"]["tokens_per_s"], SPEC_VS_OURS))
        if "hf" in grounded:
            hf, hf_k = best(grounded["hf"])
            name = f"grounded: ngram (best k={k}) vs HF prompt lookup (best k={hf_k})"
            found.append((name, ours / hf, SPEC_VS_HF_LOOKUP))
    for w, sweep in (p.get("batch_sweep") or {}).items():
        name = f"{w}, batch {sweep['largest_batch_size']}: engine default ngram k={sweep['k']}"
        name += " vs no speculation"
        found.append((name, sweep["default_vs_off_at_largest"], SPEC_LARGE_BATCH))
    return [{"name": n, "value": v, "threshold": t, "passed": v >= t} for n, v, t in found]


def _targets_table(payloads: list[dict]) -> list[str]:
    template = "{name} | {value:.2f}x | >= {threshold}x | **{verdict}**"
    rows = [
        _row(template, **t, verdict="PASS" if t["passed"] else "MISS")
        for p in payloads
        for t in targets(p)
    ]
    return ["## Targets", "", *_table("target | measured | threshold | ", rows), ""] if rows else []


def section(payload: dict, file: str) -> str:
    """One benchmark's targets and section, as the benchmark prints them when it is done."""
    lines = _targets_table([payload]) + RENDERERS[payload["benchmark"]](payload | {"_file": file})
    return "\n".join(lines).replace("{results}", ".")


def render(results_dir: Path, output: Path) -> str:
    """RESULTS.md's text for the JSON files in ``results_dir``, with links relative to
    ``output``'s folder."""
    payloads = []
    for path in sorted(results_dir.glob("*.json")):
        p = json.loads(path.read_text())
        # block_manager.json carried no name before: its file's says it.
        p |= {"benchmark": p.get("benchmark", path.stem), "_file": path.name}
        if p["benchmark"] in RENDERERS:
            payloads.append(p)
    if not payloads:
        raise ValueError(f"no benchmark JSON files in {results_dir}")
    payloads.sort(key=lambda p: list(RENDERERS).index(p["benchmark"]))
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.report` from the JSON files in "
        f"`{results_dir}`; do not edit by hand. `make bench` reruns the CPU sweep "
        "(`python -m benchmarks.run_all`) and regenerates this page.",
        "",
        *_targets_table(payloads),
    ]
    for p in payloads:
        lines += RENDERERS[p["benchmark"]](p)
    link = Path(os.path.relpath(results_dir, output.parent)).as_posix()
    return "\n".join(lines).replace("{results}", link) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--output", type=Path, default=Path("benchmarks/RESULTS.md"))
    args = parser.parse_args()
    args.output.write_text(render(args.results_dir, args.output))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
