"""Regenerates benchmarks/RESULTS.md from the JSON files the benchmarks wrote (every number in it
comes from them) and judges the targets (this module owns them): ``python -m benchmarks.report``.
"""

import json
import operator
import os
import string
from pathlib import Path

# Issue 4's CPU targets: (batch size, peer, minimum pagedspec / peer generated tokens/s).
THROUGHPUT_TARGETS = ((1, "hf-static", 1.5), (32, "hf-static", 2.0), (32, "hf-batch", 3.0))
# Issue 17: pagedspec / llama.cpp generated tokens/s at the same weight precision, per batch
# size, for the precisions it names (Q4_1 as shipped has none: pagedspec runs it in fp32).
LLAMACPP_TARGETS = ((1, 1.0), (32, 2.0))
LLAMACPP_TARGET_PRECISIONS = ("fp32", "bf16", "int8")
# Speculation (grounded workload: the best ngram k against no speculation and against HF's best
# prompt-lookup k; the sweeps' batches: the engine default against no speculation).
SPEC_VS_OURS, SPEC_VS_HF_LOOKUP, SPEC_LARGE_BATCH = 1.8, 1.2, 0.95
# Issue 14's EAGLE targets, batch 1 on held-out chat: tokens per verification (k=4, greedy),
# speedup greedy and at temperature 0.8 (sampled acceptance must beat argmax drafts').
EAGLE_TOKENS_PER_ROUND, EAGLE_SPEEDUP, EAGLE_SPEEDUP_SAMPLED = 2.5, 1.6, 1.4
# Issue 15's serving targets: at every rate, the peer's p99 TTFT / pagedspec's at least this; at
# saturation (all requests at once), pagedspec's output tokens/s / the peer's at least this.
SERVING_TTFT_P99, SERVING_THROUGHPUT = 2.0, 2.0
SERVING_PEER = "transformers"
# Issue 17: the peak resident memory of make demo's command, float32 weights, at most (GB).
DEMO_PEAK_GB = 0.9
# Issue 50, the host-overhead benchmark (tiny-llama, dummy weights, CPU): at batch 256 without
# speculation a step of at most this many ms and this many µs of host time per sequence; the step
# (batch, method) at least this many times faster than HOST_BASELINE's in the same run (batch 1:
# no slower, as SPEC_LARGE_BATCH).
HOST_STEP_MS, HOST_US_PER_SEQ, HOST_BASELINE = 4.0, 8.0, "b11ce88"
HOST_SPEEDUPS = ((256, "off", 2.5), (64, "ngram", 2.0), (1, "off", 0.95), (1, "ngram", 0.95),
                 (1, "eagle", 0.95))  # fmt: skip
HOST_PHASES = {"schedule": "schedule", "draft": "draft", "prepare": "prepare inputs",
               "sample": "sample/verify", "commit": "commit + outputs"}  # fmt: skip
# Issue 51, a CPU shared with one busy process (benchmarks.contention): pagedspec's contended /
# quiet generated tokens/s at these batch sizes at least this, and its quiet tokens/s no worse
# than with its threads fixed (as SPEC_LARGE_BATCH: within the noise of a run).
CONTENTION_BATCHES, CONTENTION_RATIO, CONTENTION_QUIET = (1, 16), 0.5, 0.95
# Issue 52, structured outputs (benchmarks.structured): JSON-schema requests / unconstrained
# throughput at batch 32; EAGLE / no speculation at batch 1, both constrained; the share of the
# 20 schemas x 2 temperatures whose answers parse and validate.
STRUCTURED_THROUGHPUT, STRUCTURED_EAGLE, STRUCTURED_VALID = 0.9, 1.3, 1.0
# Issue 53, on a GPU (gpu_check.sh's throughput sweep): the median step's share of wall time
# outside its forwards at this batch size, at most.
IDLE_BATCH, IDLE_SHARE = 64, 0.15
COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}
EAGLE_LABELS = dict(none="no speculation", eagle="eagle", **{"eagle-k4": "eagle, chains of k",
    "eagle-k4-wide": "eagle, chains of k, one leaf more",
    "eagle-chain": "eagle, no leaves", "eagle-t-chain": "eagle, sampled drafts, no leaves",
    "none-t": "no speculation",
    "eagle-t": "eagle, sampled drafts", "eagle-t-argmax": "eagle, argmax drafts"})  # fmt: skip


class _Cells(string.Formatter):
    """str.format for table rows: a missing or None value renders as an empty cell; the spec "ms"
    shows seconds in milliseconds, and a float spec with an "x" after it (".2fx") a ratio."""

    def get_field(self, name: str, args: tuple, kwargs: dict) -> tuple:
        try:
            return super().get_field(name, args, kwargs)
        except (KeyError, TypeError):  # missing, or inside a missing value
            return None, name

    def format_field(self, value: object, spec: str) -> str:
        if value is None:
            return ""
        if spec == "ms":
            return f"{value * 1e3:.1f}"
        return format(value, spec[:-1]) + "x" if spec.endswith("fx") else format(value, spec)


def _table(columns: str, rows: list[dict]) -> list[str]:
    """A markdown table; ``columns``: "header=cell template | ..." (each template formatted with
    a row's items)."""
    cols = [c.split("=", 1) for c in columns.split(" | ")]
    template = " | ".join(cell for _, cell in cols)
    head = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    return head + ["| " + _Cells().format(template, **r) + " |" for r in rows]


def _section(title: str, notes: list[str], columns: str, rows: list[dict], after=()) -> list:
    """A section of the page: its title, notes (a bulleted list), table and lines after it."""
    notes = [*notes, ""] if notes else []
    return [f"## {title}", "", *notes, *_table(columns, rows), "", *after]


def _sampling(cfg: dict) -> str:
    """How a throughput run sampled (runs from before --temperature were greedy)."""
    t = cfg.get("temperature", 0.0)
    return "greedy" if not t else f"temperature {t} (top-k and top-p off)"


def _machine(p: dict) -> list[str]:
    m = p["machine"]
    # older JSON: no SIMD level, no family and model
    details = [m[k] for k in ("cpu_capability", "cpu_model") if m.get(k)]
    simd = f" ({', '.join(details)})" if details else ""
    device = m["gpu"] or f"{m['cpu']}{simd}, {m['cores']} cores, {m['torch_threads']} torch threads"
    return [
        f"- command: `{m['command']}`",
        f"- machine: {device}; torch {m['torch']}, transformers {m['transformers']}, "
        f"python {m['python']}; commit {m['git_commit']}"
        + (f"; run {m['date']}" if m.get("date") else ""),
        f"- raw numbers: [{p['_file']}]({{results}}/{p['_file']})",
    ]


def _bandwidth(rates: dict) -> str:
    if "read_bandwidth_gbs" in rates:
        size = rates["read_bytes"] >> 20
        return f"read {rates['read_bandwidth_gbs']:.1f} GB/s (a sum over {size} MiB)"
    # runs before the read measurement: the ceiling divides by a copy's bandwidth
    return (f"copy {rates['bandwidth_gbs']:.1f} GB/s (an older run's bound: a copy also writes, "
            "so reading weights alone can pass it)")  # fmt: skip


def render_throughput(p: dict) -> list[str]:
    model, rates, cfg, rows = p["model"], p["roofline"], p["config"], []
    for r in p["results"]:
        for n, s in r["systems"].items():
            row = {"b": r["batch_size"], "n": n, "s": s, "r": r["ratios"].get(n)}
            if n == "pagedspec":
                row |= {"c": r["ceiling_tokens_per_s"], "f": r["roofline_fraction"]}
                row["rc"] = r.get("run_ceiling_tokens_per_s")  # none in older runs
            if "error" in s:  # a peer that could not run is reported, not faked
                row |= {"s": None, "error": f"unavailable: {s['error']}"}
            rows.append(row)
    used = [(r["batch_size"], r["systems"]["pagedspec"]) for r in p["results"]]
    weights = "dummy" if model["load_format"] == "dummy" else "checkpoint"
    notes = [
        *_machine(p),
        f"- workload: per batch size B, {cfg['waves']} x B requests submitted at once, "
        f"input {cfg['input_len']} tokens, output {cfg['output_len']} tokens (uniform, seed "
        f"{cfg['seed']}), {_sampling(cfg)}, ignore_eos",
        f"- each system's fastest of {cfg.get('repeats', 1)} timed runs (the systems take turns; "
        "pagedspec from a fresh engine each run, so no run hits the prefix cache)",
        f"- weights: {p['weights_note']}",
        *_precision_notes(p),
        f"- measured ceilings: {_bandwidth(rates)}, {rates['dtype']} GEMM "
        f"{rates['matmul_gflops']:.1f} GFLOP/s; model {model['num_params'] / 1e6:.1f} M matmul "
        f"parameters (layers + LM head{_lm_head(model)}), {model['weight_bytes'] / 1e6:.0f} MB "
        "read per decode step",
    ]
    columns = (
        "B={b} | system={n} | out tok/s={error}{s[output_tokens_per_s]:.1f} | "
        "total tok/s={s[total_tokens_per_s]:.1f} | req/s={s[requests_per_s]:.2f} | "
        "TTFT p50 / p99 ms={s[ttft_median_s]:ms} / {s[ttft_p99_s]:ms} | "
        "TPOT p50 / p99 ms={s[tpot_median_s]:ms} / {s[tpot_p99_s]:ms} | "
        "pagedspec / peer={r:.2f} | decode ceiling tok/s={c:.0f} | of ceiling={f:.1%} | "
        "run ceiling tok/s={rc:.0f} | step ms={s[step_wall_s_p50]:ms} | "
        "device ms={s[step_device_s_p50]:ms} | device idle={s[device_idle_share_p50]:.0%}"
    )
    blocks = ", ".join(f"B={b}: {s['peak_kv_blocks_used']}/{s['num_kv_blocks']}" for b, s in used)
    after = [
        f"pagedspec peak KV blocks used / allocated: {blocks}; preemptions: "
        f"{sum(s['preemptions'] for _, s in used)}.",
        "The decode ceiling bounds decode alone; the fraction divides generated tokens/s, whose "
        "time includes prefill, by it. The run ceiling is the whole timed run's rate were its "
        "matmuls all it did, at the measured rates: each prompt token's layer FLOPs at the GEMM "
        "rate, then decode at the decode ceiling. Step ms / device ms: pagedspec's median step, "
        "wall time and its forwards' device time (CUDA events on CUDA, the host's clock on the "
        "CPU); device idle: the median step's share of wall time outside its forwards.",
        "",
    ]
    if p.get("plot"):  # none where matplotlib is missing (the GPU check)
        after += [f"![throughput]({{results}}/{p['plot']})", ""]
    graphs = ", CUDA graphs off" if cfg.get("enforce_eager") else ""
    graphs += ", async scheduling" if cfg.get("async_scheduling") else ""
    title = f"Throughput: {model['name']} ({model['dtype']}, {weights} weights{graphs})"
    return _section(title, notes, columns, rows, after)


def _lm_head(model: dict) -> str:
    """The LM head's share of the matmul parameters (runs before the run ceiling: none)."""
    head = model.get("lm_head_params")
    return "" if head is None else f" of {head / 1e6:.1f} M"


def _precision_notes(p: dict) -> list[str]:
    """The throughput run's --precision and its llama.cpp peer (file, build) or why skipped."""
    notes, q = [], p.get("precision")
    if q:
        quant = f", quantization={q['quantization']}" if q["quantization"] else ""
        kv = q.get("kv_cache_dtype", "auto")  # runs before the option: the model's dtype
        quant += f", kv_cache_dtype={kv}" if kv != "auto" else ""
        peer = "llamacpp" in p.get("config", {}).get("peers", [])
        llama = f"; llama.cpp {q['gguf_type']}, KV F16 ({q['note']})" if peer else ""
        notes.append(f"- precision {q['name']}: pagedspec dtype={q['dtype']}{quant}{llama}")
    for name, info in p.get("peers", {}).items():
        notes.append(f"- {name}: llama-cpp-python {info['version']} built from source, "
                     f"`llama_batch` continuous batching, one sequence id per request, "
                     f"{info['gguf_type']} GGUF written by its own quantizer from the shipped "
                     f"file (`{os.path.basename(info['gguf'])}`)")  # fmt: skip
    notes += [f"- {name} skipped: {why}" for name, why in p.get("skipped_peers", {}).items()]
    return notes


def render_accuracy(p: dict) -> list[str]:
    text, prompts = p["text"], p["prompts"]
    notes = [
        *_machine(p),
        f"- greedy agreement with pagedspec fp32 (float32 weights, compute and KV cache): "
        f"{prompts['num']} fixture prompts (HF test "
        f"prompts + examples/prompts.jsonl), {prompts['max_tokens']} tokens each, EOS ignored; "
        "'identical': share of outputs equal to fp32's; 'prefix': mean common-prefix tokens",
        f"- perplexity: `benchmarks/data/{text['file']}` ({text['tokens']} tokens), "
        f"{text['windows']} non-overlapping windows of {p['config']['window']}, "
        f"{text['scored_tokens']} scored tokens; pagedspec teacher-forced through its "
        "ModelRunner, llama.cpp one batch per window",
        "- llama.cpp: " + (f"llama-cpp-python {p['llamacpp']['version']}, GGUF files written by "
                           "its quantizer from the shipped Q4_1" if "version" in p["llamacpp"]
                           else f"unavailable: {p['llamacpp']['error']}"),
    ]  # fmt: skip
    rows = []
    for r in p["rows"]:
        rows.append({"r": r} | {f"{k}_error": f"unavailable: {r[k]['error']}"
                                for k in ("pagedspec", "llamacpp") if "error" in r[k]})  # fmt: skip
    columns = (
        "precision={r[precision]} | pagedspec options={r[pagedspec_options]} | "
        "identical={pagedspec_error}{r[pagedspec][identical]:.0%} | "
        "prefix={r[pagedspec][mean_common_prefix]:.1f} | "
        "perplexity={r[pagedspec][perplexity]:.3f} | "
        "llama.cpp={r[gguf_type]} | identical={llamacpp_error}{r[llamacpp][identical]:.0%} | "
        "prefix={r[llamacpp][mean_common_prefix]:.1f} | perplexity={r[llamacpp][perplexity]:.3f}"
    )
    return _section(f"Accuracy by weight precision: {p['model']}", notes, columns, rows)


def render_latency(p: dict) -> list[str]:
    cfg = p["config"]
    q = lambda k: f"{{{k}[p50]:ms}} / {{{k}[p90]:ms}} / {{{k}[p99]:ms}}"
    notes = [
        *_machine(p),
        f"- workload: grounded chat prompts, {cfg['output_len']} output tokens each (ignore_eos), "
        f"{cfg['warmup_iters']} warm-up + {cfg['iters']} measured iterations per row",
    ]
    columns = f"config={{config}} | B={{batch_size}} | TTFT p50/p90/p99 ms={q('ttft_s')} | "
    columns += f"TPOT p50/p90/p99 ms={q('tpot_s')} | batch ms={q('batch_latency_s')} | "
    columns += "acceptance={acceptance_rate:.0%}"
    return _section(f"Latency: {p['model']}", notes, columns, p["results"])


SPEC_COLUMNS = (
    "workload={w} | system={system} | speculation={label} | tok/s={r[tokens_per_s]:.1f} | "
    "speedup={speedup:.2f} | acceptance={r[acceptance_rate]:.0%} | "
    "tokens/round={r[mean_accepted_length]:.2f} | drafts/round={r[drafts_per_verification]:.2f} | "
    "acceptance by draft position={by_position} | "
    "same tokens={r[same_tokens_as_reference]:.0%}"
)
SWEEP_COLUMNS = (
    "B={b} | off tok/s={a[tokens_per_s]:.1f} | forced tok/s={c[tokens_per_s]:.1f} | "
    "forced / off={ratio:.2f} | acceptance={c[acceptance_rate]:.0%} | tokens/verification="
    "{c[tokens_per_verification]:.2f} | same tokens={c[same_tokens]:.0%} | default tok/s="
    "{d[tokens_per_s]:.1f} | default / off={ratio_default:.2f} | default acceptance="
    "{d[acceptance_rate]:.0%} | default tokens/verification={d[tokens_per_verification]:.2f} | "
    "default same tokens={d[same_tokens]:.0%}"
)
EAGLE_COLUMNS = (
    "speculation={label} | temperature={r[temperature]} | tok/s={r[tokens_per_s]:.1f} | "
    "speedup={speedup:.2f} | acceptance={r[acceptance_rate]:.0%} | tokens/verification="
    "{r[mean_accepted_length]:.2f} | of them from leaves={leaves} | "
    "drafts/verification={drafts:.2f} | "
    "acceptance by draft position={by_position} | "
    "same tokens={r[same_tokens_as_reference]:.0%} | speedup by pass={by_pass}"
)


def render_spec_decode(p: dict) -> list[str]:
    cfg, rows, lines = p["config"], [], [f"## Speculative decoding: {p['model']}", "", *_machine(p)]
    for w, systems in p["workloads"].items():
        for system, runs in systems.items():
            ours, none = system == "pagedspec", runs["none"]["tokens_per_s"]
            for k, r in runs.items():
                label = f"{'ngram' if ours else 'prompt lookup'} k={k}"
                by_position = (f"{a:.0%}" for a in r.get("acceptance_by_position", ()))
                rows.append({"w": w, "r": r, "speedup": r["tokens_per_s"] / none,
                    "label": "no speculation" if k == "none" else label,
                    "by_position": " / ".join(by_position),
                    "system": "pagedspec" if ours else "HF generate"})  # fmt: skip
    if rows:
        lines += [f"- batch 1, greedy, up to {cfg['max_tokens']} tokens (stop at EOS), "
                  f"{cfg['num_prompts']} prompts per workload; 'same tokens' is the share of "
                  "prompts whose output equals pagedspec's without speculation", "",
                  *_table(SPEC_COLUMNS, rows)]  # fmt: skip
    for workload, sweep in p["batch_sweep"].items():
        lines += _render_sweep(workload, sweep)
    lines += _render_eagle(p["eagle"]) if p.get("eagle") else []
    plotted = rows and p.get("plot")  # (the GPU check carries no matplotlib)
    return [*lines, "", *([f"![speedup vs k]({{results}}/{p['plot']})", ""] if plotted else [])]


def _sweep_rows(rows: dict, names: tuple[str, str]) -> list[dict]:
    """Per batch size: both configs' rows, and the second's ratio to the first (off): the
    median over the rounds of their ratio, ``vs_off``."""
    out = []
    for b, a in rows[names[0]].items():
        c = rows[names[1]].get(b, {})
        ratio = c.get("vs_off")
        out.append({"b": b, "a": a, "c": c, "ratio": ratio})
    return out


def _render_sweep(workload: str, sweep: dict) -> list[str]:
    rows = _sweep_rows(sweep["rows"], ("off", "forced"))
    for r in rows:
        r["d"] = sweep["rows"]["default"].get(r["b"], {})
        r["ratio_default"] = r["d"].get("vs_off")
    crossover = sweep["crossover_batch_size"]
    return [
        "",
        f"Batch sweep, {workload} prompts: up to {sweep['max_tokens']} tokens, "
        f"{sweep.get('method', 'ngram')} k={sweep['k']} forced on at every batch size vs off; "
        f"'default' is the engine's SpeculativeConfig (speculation off at >= "
        f"{sweep['default_disable_batch_size']} running or waiting sequences); the configs take "
        f"turns, {sweep['repeats']} rounds: tok/s is each config's best run, '/ off' the median "
        "over the rounds of the round's ratio (drift on the host cancels within a round); "
        "'same tokens': the share of requests, over the rounds, whose greedy tokens equal off's.",
        "",
        *_table(SWEEP_COLUMNS, rows),
        "",
        f"Measured crossover (up to B={sweep['largest_batch_size']}): forced speculation is "
        + (f"first slower than none at B={crossover}." if crossover else "never slower than none."),
    ]


def _render_eagle(e: dict) -> list[str]:
    runs, cost = e["runs"], e["draft_cost"]
    reference = {0: runs["none"], 1: runs["none-t"]}
    rows = [{"label": EAGLE_LABELS[name], "r": r,
             "speedup": r["tokens_per_s"] / reference[r["temperature"] > 0]["tokens_per_s"],
             "by_pass": _speedup_by_pass(r, reference[r["temperature"] > 0]),
             "drafts": r.get("drafts_per_verification", 0.0),
             "by_position": " / ".join(f"{a:.0%}" for a in r.get("acceptance_by_position", [])),
             "leaves": f"{r['leaf_tokens_per_verification']:.2f}"
             if r.get("leaf_tokens_per_verification") is not None else ""}
            for name, r in runs.items()]  # fmt: skip
    return [
        "",
        f"EAGLE, held-out open chat prompts (`benchmarks/data/chat_heldout.jsonl`), head: "
        f"{e['head']}. Batch 1, k={e['k']}, up to {e['max_tokens']} tokens (stop at EOS), "
        f"{e['num_prompts']} prompts, {e.get('passes', 1)} timed passes over them; speedup "
        "against no speculation at the same temperature (pooled over the passes; 'by pass': "
        "each pass's); 'same tokens' as above (greedy only).",
        "",
        *_table(EAGLE_COLUMNS, rows),
        "",
        f"Draft cost: {cost['draft_s_per_token'] * 1e3:.2f} ms per draft token (the median "
        f"`propose` call that drafts k tokens, / k) against {cost['target_step_s'] * 1e3:.2f} ms "
        "per target decode step (the median `ModelRunner.forward` without speculation): "
        f"{cost['share']:.1%} of a target step.",
        *(_render_sweep("held-out chat", e["batch_sweep"]) if e["batch_sweep"] else []),
    ]


def _speedup_by_pass(r: dict, reference: dict) -> str:
    """Each pass's speedup of run ``r`` over ``reference`` ("" for a single pass)."""
    ours, theirs = r.get("tokens_per_s_by_pass", []), reference.get("tokens_per_s_by_pass", [])
    return " / ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs, strict=True))


def render_host_overhead(p: dict) -> list[str]:
    cfg, trees, rows = p["config"], p["trees"], []
    labels = {name: _tree(name, t) for name, t in trees.items()}
    for r in p["results"]:
        b = r["batch_size"]
        for name in trees:
            t = r[name]
            rows.append({"b": b, "method": r["method"], "tree": labels[name],
                "wall": t["wall_s"] * 1e3, "model": t["model_s"] * 1e3,
                "draft": t["draft_model_s"] * 1e3, "host": t["host_s"] / b * 1e6,
                "p": {k: v / b * 1e6 for k, v in t["phases_s"].items()},
                "tokens": t["tokens_per_seq_step"],
                "speedup": r.get("speedup") if name == "current" else None})  # fmt: skip
    timed = {name: ", ".join(f"`{path}`" for path in t["timed"]) for name, t in trees.items()}
    notes = [
        *_machine(p),
        f"- {p['model']} with dummy weights, float32 on the CPU; per batch size B, B requests of "
        f"{cfg['prompt_len']} random prompt tokens (ngram: 4 of them repeated), greedy, EOS "
        f"ignored; ngram and eagle (a random head, its draft tree on) k={cfg['k']}, forced on at "
        f"every B; after prefill and {cfg['warmup_steps']} decode steps, {cfg['steps']} timed "
        f"decode steps; each figure the median step of a round, then the median over "
        f"{cfg['rounds']} rounds (seed {cfg['seed']})",
        "- step: `engine.step()`'s wall time; model: the target's forward and compute_logits; "
        "draft model: the EAGLE head's; host: (step - model - draft model) / B, by phase (each "
        "a median of its own, so they need not add up) as the methods below split it: schedule, "
        "draft (`propose` less the draft model), prepare inputs (the runner's forward less the "
        "model, speculation's prepare less the draft), sample/verify (the step sampler, "
        "speculation's verify), commit + outputs (the rest of the step)",
        *(f"- methods timed, {labels[name]}: {paths}" for name, paths in timed.items()),
    ]
    if "baseline" in trees:
        notes.append("- the trees run in the same run and take turns on every configuration, "
                     "round by round; 'vs baseline': the median over the rounds of the "
                     "baseline's step time / the current tree's")  # fmt: skip
    phases = " | ".join(f"{label} µs/seq={{p[{k}]:.1f}}" for k, label in HOST_PHASES.items())
    columns = (
        "B={b} | speculation={method} | tree={tree} | step ms={wall:.2f} | model ms={model:.2f} | "
        f"draft model ms={{draft:.2f}} | host µs/seq={{host:.1f}} | {phases} | "
        "tokens/seq/step={tokens:.2f} | vs baseline={speedup:.2fx}"
    )
    after = [f"![host µs per sequence]({{results}}/{p['plot']})", ""] if p.get("plot") else []
    return _section("Host overhead of an engine step", notes, columns, rows, after)


def _tree(name: str, tree: dict) -> str:
    """A tree's label: its name and commit (the current one: with uncommitted changes, if so)."""
    changed = ", uncommitted changes" if tree.get("uncommitted_changes") else ""
    return f"{name} ({tree['commit']}{changed})"


def render_contention(p: dict) -> list[str]:
    cfg = p["config"]
    notes = [
        *_machine(p),
        f"- the default model, greedy, EOS ignored; per batch size B, B random prompts of "
        f"{cfg['input_len']} tokens (seed {cfg['seed']}) making {cfg['output_len']} each, "
        "submitted at once; "
        f"contended: with `{cfg['busy_process']}` running beside it; the median of "
        f"{cfg['rounds']} rounds (quiet, then contended, each after a warm-up run)",
        "- pagedspec: threads from the load (`pagedspec.engine.worker.cpu_threads`, "
        f"at most {cfg['cpu_limit']}); "
        f"pagedspec-fixed: {cfg['cpu_limit']} threads whatever else runs"
        + (f"; llama.cpp: not run ({p['llamacpp_skipped']})" if p["llamacpp_skipped"] else ""),
    ]
    columns = "B={batch_size} | system={system} | quiet tok/s={quiet_tokens_per_s:.1f} | "
    columns += "contended tok/s={contended_tokens_per_s:.1f} | contended / quiet="
    columns += "{contended_vs_quiet:.2fx}"
    return _section("A CPU shared with a busy process", notes, columns, p["results"])


def render_structured(p: dict) -> list[str]:
    cfg, t, s, m = p["config"], p["throughput"], p["speculation"], p["mask_cost"]
    valid = p["validity"]["rows"]
    failed = [f"{r['schema']} at T={r['temperature']} ({r['finish_reason']})"
              for r in valid if not r["valid"]]  # fmt: skip
    notes = [
        *_machine(p),
        f"- validity: the 20 schemas of data/json_schemas.json at temperature 0 and 0.8 (seed "
        f"{cfg['seed']}), at most "
        f"{cfg['validity_max_tokens']} tokens: {sum(r['valid'] for r in valid)} of {len(valid)} "
        "parse and validate (jsonschema)" + (f"; not: {', '.join(failed)}" if failed else ""),
        f"- throughput: batch {cfg['batch_size']}, {cfg['max_tokens']} tokens each (EOS "
        f"ignored), the median of {cfg['rounds']} rounds after a warm-up one; speculation: batch "
        f"1, {cfg['eagle_prompts']} held-out chat prompts asking for a list of records, greedy, "
        f"at most {cfg['eagle_max_tokens']} tokens, EAGLE k=4 (shipped head) against none, "
        f"taking turns over {cfg.get('eagle_passes', 1)} passes after a warm-up one: speedup by "
        f"pass {', '.join(f'{x:.2f}x' for x in s.get('speedup_by_pass', []))}; "
        f"{s.get('leaf_tokens', 0)} tokens from draft-tree leaves",
        f"- mask cost at batch 1: {m['engine_us_per_row']:.1f} µs per masked row in the engine "
        f"(bitmask filled, unpacked, applied), llguidance's bitmask alone "
        f"{m['llguidance_bitmask_us']:.1f} µs (median of {m['rows']} steps)",
    ]
    same = "yes" if s["identical_tokens"] else "NO"
    rows = [
        {"run": "JSON schema", "tps": t["tokens_per_s"]["constrained"],
         "vs": t["constrained_vs_unconstrained"], "what": "vs unconstrained"},
        {"run": "unconstrained", "tps": t["tokens_per_s"]["unconstrained"]},
        {"run": "JSON schema, EAGLE", "tps": s["tokens_per_s"]["eagle"], "vs": s["speedup"],
         "what": "vs no speculation", "tpv": s["tokens_per_verification"], "same": same},
        {"run": "JSON schema, no speculation", "tps": s["tokens_per_s"]["off"]},
    ]  # fmt: skip
    columns = "run={run} | tok/s={tps:.1f} | ratio={vs:.2fx} | ={what} | tokens per "
    columns += "verification={tpv:.2f} | same tokens={same}"
    by_schema: dict[str, dict] = {}
    for r in valid:
        verdict = "valid" if r["valid"] else "INVALID"
        cell = f"T {r['temperature']}: {verdict} ({r['finish_reason']}, {r['tokens']} tokens)"
        key = "greedy" if r["temperature"] == 0 else "sampled"
        by_schema.setdefault(r["schema"], {"schema": r["schema"]})[key] = cell
    each = _table("schema={schema} | greedy={greedy} | sampled={sampled}", list(by_schema.values()))
    return _section("Structured outputs", notes, columns, rows, [*each, ""])


def render_block_manager(p: dict) -> list[str]:
    cfg, us = p["config"], ("median", "p90", "p99", "append", "slot_ids", "truncate", "commit")
    rows = [{"on": "on" if r["prefix_caching"] else "off", "r": r} for r in p["results"]]
    notes = [
        "- config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) + f"; python {p['python']}",
        f"- raw numbers: [{p['_file']}]({{results}}/{p['_file']})",
        f"- µs per step for {cfg['num_seqs']} sequences, 1 + {cfg['lookahead']} slots each, "
        f"block size {cfg['block_size']} (append, slot ids, truncate, commit)",
    ]
    columns = "prefix cache={on} | " + " | ".join(f"{k}={{r[{k}_us]:.1f}}" for k in us)
    return _section("KV block manager bookkeeping", notes, columns, rows)


def render_memory(p: dict) -> list[str]:
    cfg, rows = p["config"], []
    for r in p["results"]:
        mib = [b / 2**20 for b in r["peak_rss_bytes"]]
        runs = " / ".join(f"{m:.0f}" for m in mib)
        wall = " / ".join(f"{s:.1f}" for s in r["wall_s"])
        rows.append(r | {"peak": max(mib), "runs": runs, "wall": wall})
    notes = [
        *_machine(p),
        f"- {cfg['repeats']} runs of `make demo`'s command per precision, after one unmeasured "
        "run (the kernel's peak covers the child's own children, a first build's g++ too), at most "
        f"{cfg['max_tokens']} tokens per prompt, model: {cfg['model'] or 'the default model'}; "
        "the peak RSS of each run (a child process; the kernel's maximum resident set size, as "
        "`/usr/bin/time -v` reports it), in MiB",
    ]
    columns = "precision={precision} | peak MiB={peak:.0f} | each run MiB={runs} | "
    columns += "wall s={wall} | command=`{command}`"
    return _section("Memory: `make demo`", notes, columns, rows)


def render_linear(p: dict) -> list[str]:
    dtypes = [
        (d, pre) for d, pre in (("float32", ""), ("bf16", "bf16_")) if f"{pre}weight_bytes" in p
    ]
    sizes = ", ".join(f"{p[pre + 'weight_bytes'] / 1e6:.0f} MB in {d}" for d, pre in dtypes)
    if [d for d, _ in dtypes] == ["float32"]:  # the runs before bf16, in their words
        sizes = f"{p['weight_bytes'] / 1e6:.0f} MB of weights"
    notes = [
        *_machine(p),
        f"- one pass = every projection of every layer plus the LM head ({sizes}), median of "
        f"{p['repeats']} alternated passes, {p['threads']} threads",
    ]
    title = "Linear layers: pagedspec `Linear` (packed C++ GEMM) vs `F.linear` and oneDNN"
    columns = "rows={rows}"
    for _, pre in dtypes:
        tag = "" if pre == "" else " bf16"
        columns += f" | F.linear{tag} ms={{{pre}f_linear_ms:.1f}} | oneDNN packed{tag} ms="
        columns += f"{{{pre}onednn_ms:.1f}} | Linear{tag} ms={{{pre}linear_ms:.1f}} | "
        columns += (
            f"vs F.linear{tag}={{{pre}speedup:.2fx}} | vs oneDNN{tag}={{{pre}vs_onednn:.2fx}}"
        )
        columns += f" | Linear{tag} GB/s={{{pre}linear_gbs:.1f}} | Linear{tag} GFLOP/s="
        columns += f"{{{pre}linear_gflops:.0f}}"
    if any("int8_ms" in r for r in p["results"]):
        columns += " | int8 Linear ms={int8_ms:.1f} | int8 vs Linear={int8_vs_linear:.2fx} | "
        columns += "int8 GB/s={int8_gbs:.1f} | _weight_int8pack_mm ms={int8pack_mm_ms:.1f} | "
        columns += "_weight_int8pack_mm bf16 x ms={int8pack_mm_bf16_ms:.1f} | "
        columns += "oneDNN int8 (int8 x) ms={onednn_int8_ms:.1f}"
    if any("q4_1_ms" in r for r in p["results"]):
        columns += " | Q4_1 Linear ms={q4_1_ms:.1f} | Q4_1 vs Linear={q4_1_vs_linear:.2fx} | "
        columns += "Q4_1 GB/s={q4_1_gbs:.1f}"
    return _section(f"{title} ({p['model']})", notes, columns, p["results"])


def render_kernels(p: dict) -> list[str]:
    if p.get("device") != "cpu":
        return render_gpu_kernels(p)
    notes = [
        *_machine(p),
        f"- one call = one layer; {', '.join(f'{k}={v}' for k, v in p['shape'].items())}; "
        f"batch {'/'.join(sorted({str(r['batch']) for r in p['rows']}))}, contexts uniform in "
        f"100..1000; {p['threads']} threads",
    ]
    title = "Paged attention on the CPU: C++ kernel (`cpu`) vs gather + SDPA (`torch`)"
    columns = "span={span} | backend={backend} | median µs={median_us:.0f} | "
    columns += "K/V GB/s={gb_per_s:.1f} | ms per 30 layers={ms_per_step_30_layers:.1f} | "
    columns += "vs torch={speedup_vs_torch:.2fx}"
    return _section(title, notes, columns, p["rows"])


SERVING_COLUMNS = (
    "workload={w} | system={s} | rate req/s={r[rate]} | done / failed={r[completed]} / "
    "{r[failed]} | seconds={r[duration_s]:.1f} | in / out tokens={r[input_tokens]} / "
    "{r[output_tokens]} | req/s={r[request_throughput]:.2f} | out tok/s="
    "{r[output_throughput]:.1f} | goodput req/s={r[goodput]:.2f} | "
    + " | ".join(f"{n} mean / p50 / p99 ms={{r[{k}][mean]:ms}} / {{r[{k}][p50]:ms}} / "
                 f"{{r[{k}][p99]:ms}}" for n, k in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"),
                                                   ("ITL", "itl_s"), ("E2E", "e2e_s")))
)  # fmt: skip


def render_serving(p: dict) -> list[str]:
    cfg, slo = p["config"], p["slo"]
    notes = [
        *_machine(p),
        *(f"- {s}: `{v['command']}`" for s, v in p["systems"].items()),
        f"- one asyncio httpx client streams every request (SSE, usage in the last chunk) to "
        f"each server in turn; {cfg['num_prompts']} requests per rate after {cfg['warmup']} "
        f"unmeasured ones; gamma arrivals of burstiness {cfg['burstiness']} (1: Poisson), seed "
        f"{cfg['seed']}; rate inf: all at once",
        f"- random: seeded random token prompts of {cfg['input_len']} tokens (decoded to text; "
        f"'in tokens' is the server's count), {cfg['output_len']} output tokens, greedy, "
        "EOS ignored; chat: the prompts of `benchmarks/data/chat_heldout.jsonl`, greedy answers "
        f"up to {cfg['chat_max_tokens']} tokens (stop at EOS)",
        f"- goodput: completed requests per second with TTFT <= {slo['ttft_s']} s and TPOT <= "
        f"{slo['tpot_s'] * 1e3:.0f} ms; TPOT: (end-to-end - TTFT) / (output tokens - 1); ITL: "
        "gaps between streamed chunks",
    ]
    rows = [{"w": w, "s": s, "r": r} for s, v in p["systems"].items()
            for w, rs in v["workloads"].items() for r in rs]  # fmt: skip
    after = [f"![latency vs rate]({{results}}/{p['plot']})", ""]
    return _section(f"Online serving: {p['model']}", notes, SERVING_COLUMNS, rows, after)


def render_soak(p: dict) -> list[str]:
    cfg, m, shares = p["config"], p["rss_mb"], p["config"]["shares"]
    notes = [
        *_machine(p),
        f"- server: `{p['server']}`",
        f"- {cfg['num_requests']} requests, Poisson arrivals over {cfg['duration']:.0f} s "
        f"({p['rate']:.2f} req/s; the last answered after {p['seconds']:.0f} s), seed "
        f"{cfg['seed']}: {shares['invalid']:.0%} invalid, {shares['disconnect']:.0%} that "
        f"disconnect mid-stream, {shares['abort']:.0%} that give up at a random moment; the rest "
        f"valid (half streamed, half chat, up to {cfg['max_tokens']} tokens; every 4th a greedy "
        f"probe over {cfg['probes']} prompts); {p['output_tokens']} tokens in whole answers",
        f"- server aborts counted by /metrics: {p['server_aborts']:.0f}; resident memory "
        f"{m['first']} MB first, {m['half_min']} - {m['half_max']} MB over the second half, "
        f"{m['last']} MB last ({m['samples']} samples; tolerance {cfg['rss_tolerance']:.0%})",
    ]
    rows = [{"kind": k, "c": c, "statuses": ", ".join(f"{s}: {n}" for s, n in c["statuses"]
             .items())} for k, c in p["counts"].items()]  # fmt: skip
    checks = [{"name": k, "verdict": ("FAIL", "pass")[c["passed"]], "detail": c["detail"]}
              for k, c in p["checks"].items()]  # fmt: skip
    after = ["", *_table("check={name} | verdict=**{verdict}** | detail={detail}", checks), ""]
    columns = "requests={kind} | sent={c[sent]} | answered whole={c[ok]} | HTTP statuses={statuses}"
    return _section(f"Soak: {p['model']}", notes, columns, rows, after)


def render_gpu_kernels(p: dict) -> list[str]:
    """benchmarks/gpu_check.sh's kernel run (RESULTS-GPU.md)."""
    shape = ", ".join(f"{k}={v}" for k, v in p["shape"].items())
    notes = [*_machine(p), f"- one call = one layer; {shape}; device copy "
             f"{p['copy_bandwidth_gb_per_s']:.0f} GB/s; xformers: {p['xformers']}; skipped: "
             f"{len(p['skipped'])} cases"]  # fmt: skip
    title = f"Paged attention on {p['device']}: Triton vs xFormers vs gather + SDPA (`torch`)"
    columns = "span={span} | batch={batch} | context={context} | backend={backend} | "
    columns += "splits={splits} | median µs={median_us:.1f} | K/V GB/s={gb_per_s:.0f} | "
    columns += "of copy={of_copy_bw:.0%} | rel. error={rel_err_vs_fp32:.1e}"
    errors = [f"- {r['backend']} at span {r['span']}, batch {r['batch']}, context "
              f"{r['context']}: {r['error']}" for r in p["rows"] if "error" in r]  # fmt: skip
    rows = [r for r in p["rows"] if "error" not in r]
    return _section(title, notes, columns, rows, [*errors, ""] if errors else ())


def render_run_all(p: dict) -> list[str]:
    kind = "quick run" if p["quick"] else "full CPU sweep"
    when = f", started {p['started']}" if p.get("started") else ""
    title = f"Run: `python -m benchmarks.run_all` ({kind}, {p['total_s'] / 60:.1f} min{when})"
    columns = "benchmark={name} | seconds={seconds:.0f} | exit={returncode} | command=`{command}`"
    return _section(title, [], columns, p["runs"])


# benchmark name: its renderer, in the page's order.
NAMES = ("throughput", "accuracy", "latency", "spec_decode", "host_overhead", "serving", "soak",
         "memory", "contention", "structured", "block_manager", "linear", "kernels",
         "run_all")  # fmt: skip
RENDERERS = {name: globals()[f"render_{name}"] for name in NAMES}


def targets(p: dict) -> list[dict]:
    """The targets ``p``'s benchmark measured: name, value, threshold, whether it passed."""
    found = []  # (name, value, threshold[, unit, strictly above])
    if p["benchmark"] == "throughput" and not p.get("config", {}).get("temperature"):  # greedy
        ratios = {r["batch_size"]: r["ratios"] for r in p["results"]}
        rows = {r["batch_size"]: r for r in p["results"]}
        for b, peer, least in THROUGHPUT_TARGETS:
            if peer in ratios.get(b, {}):
                name = f"throughput, batch {b}: pagedspec vs {peer}"
                found.append((name, ratios[b][peer], least))
        q = p.get("precision") or {}
        for b, least in LLAMACPP_TARGETS * (q.get("name") in LLAMACPP_TARGET_PRECISIONS):
            if "llamacpp" in ratios.get(b, {}):
                name = f"throughput, batch {b}: pagedspec {q['name']} vs llama.cpp {q['gguf_type']}"
                bound = _run_ceiling_ratio(rows[b], "llamacpp")
                found.append((name, ratios[b]["llamacpp"], least, "x", ">=", bound))
    if p["benchmark"] == "throughput" and p.get("config", {}).get("device") == "cuda":
        for r in p["results"]:
            idle = r["systems"]["pagedspec"].get("device_idle_share_p50")
            if r["batch_size"] == IDLE_BATCH and idle is not None:
                name = f"device idle share of a step, batch {IDLE_BATCH}"
                found.append((name, idle, IDLE_SHARE, "", "<="))
    grounded = p.get("workloads", {}).get("grounded") if p["benchmark"] == "spec_decode" else None
    if grounded:
        # The fastest k's tokens/s and its k.
        best = lambda runs: max((r["tokens_per_s"], k) for k, r in runs.items() if k != "none")
        ours, k = best(grounded["pagedspec"])
        name = f"grounded: ngram (best k={k}) vs pagedspec without speculation"
        found.append((name, ours / grounded["pagedspec"]["none"]["tokens_per_s"], SPEC_VS_OURS))
        if "hf" in grounded:
            hf, hf_k = best(grounded["hf"])
            name = f"grounded: ngram (best k={k}) vs HF prompt lookup (best k={hf_k})"
            found.append((name, ours / hf, SPEC_VS_HF_LOOKUP))
    for w, sweep in (p.get("batch_sweep") or {}).items():
        name = f"{w}, batch {sweep['largest_batch_size']}: engine default ngram k={sweep['k']}"
        value = sweep["default_vs_off_at_largest"]
        found.append((name + " vs no speculation", value, SPEC_LARGE_BATCH))
    if p.get("eagle"):
        e = p["eagle"]
        tps = {n: r["tokens_per_s"] for n, r in e["runs"].items()}
        acc = {n: r.get("acceptance_rate") for n, r in e["runs"].items()}
        sampled = (acc["eagle-t"] or 0) / acc["eagle-t-argmax"] if acc["eagle-t-argmax"] else None
        found += [
            (f"eagle: tokens per verification, k={e['k']}, greedy",
             e["runs"].get("eagle-k4", e["runs"]["eagle"]).get("mean_accepted_length"),
             EAGLE_TOKENS_PER_ROUND, ""),
            ("eagle: speedup vs no speculation, greedy", tps["eagle"] / tps["none"], EAGLE_SPEEDUP),
            ("eagle: speedup vs no speculation, temperature 0.8", tps["eagle-t"] / tps["none-t"],
             EAGLE_SPEEDUP_SAMPLED),
            ("eagle: acceptance at temperature 0.8, sampled / argmax drafts", sampled, 1.0, "x",
             ">"),
        ]  # fmt: skip
        sweep = e["batch_sweep"]  # None: run with --eagle-batch-sizes ''
        for row in _sweep_rows(sweep["rows"], ("off", "default")) if sweep else []:
            name = f"eagle, batch {row['b']}: engine default vs no speculation"
            found.append((name, row["ratio"], SPEC_LARGE_BATCH))
    if p["benchmark"] == "serving":
        found += _serving_targets(p["systems"])
    if p["benchmark"] == "host_overhead":
        found += _host_overhead_targets(p)
    if p["benchmark"] == "structured":
        found += [
            (f"structured: JSON schema vs unconstrained, batch {p['config']['batch_size']}",
             p["throughput"]["constrained_vs_unconstrained"], STRUCTURED_THROUGHPUT),
            ("structured: EAGLE vs no speculation, batch 1, same constraint",
             p["speculation"]["speedup"], STRUCTURED_EAGLE),
            ("structured: answers that parse and validate, 20 schemas x T 0 / 0.8",
             p["validity"]["valid_share"], STRUCTURED_VALID, ""),
        ]  # fmt: skip
    if p["benchmark"] == "contention":
        found += _contention_targets(p["results"])
    if p["benchmark"] == "memory":
        fp32 = [r for r in p["results"] if r["precision"] == "fp32"]
        name = "make demo: peak resident memory, fp32"
        found += [(name, max(r["peak_rss_bytes"]) / 1e9, DEMO_PEAK_GB, " GB", "<=") for r in fp32]
    out = []
    for f in found:  # (name, value, threshold), then unit ("x"), comparison (">=") and the run
        # ceiling over the peer (None)
        name, value, threshold, unit, op, bound = (*f, *("x", ">=", None)[len(f) - 3 :])
        passed = value is not None and COMPARISONS[op](value, threshold)
        out.append({"name": name, "value": value, "threshold": threshold, "unit": unit,
                    "op": op, "passed": passed, "bound": bound})  # fmt: skip
    return out


def _run_ceiling_ratio(row: dict, peer: str) -> float | None:
    """A throughput row's run ceiling over ``peer``'s generated tokens/s (None: a run
    from before the run ceiling)."""
    ceiling = row.get("run_ceiling_tokens_per_s")
    return ceiling and ceiling / row["systems"][peer]["output_tokens_per_s"]


def _serving_targets(systems: dict) -> list[tuple]:
    if "pagedspec" not in systems or SERVING_PEER not in systems:
        return []
    found, ours, peer = [], systems["pagedspec"]["workloads"], systems[SERVING_PEER]["workloads"]
    for w, rows in ours.items():
        for r, q in zip(rows, peer.get(w, ()), strict=False):
            name = f"serving, {w}, rate {r['rate']}: p99 TTFT, {SERVING_PEER} / pagedspec"
            found.append((name, q["ttft_s"]["p99"] / r["ttft_s"]["p99"], SERVING_TTFT_P99))
            if r["rate"] == "inf":
                name = f"serving, {w}, all at once: output tok/s, pagedspec / {SERVING_PEER}"
                ratio = r["output_throughput"] / q["output_throughput"] if q["completed"] else None
                found.append((name, ratio, SERVING_THROUGHPUT))
    return found


def _host_overhead_targets(p: dict) -> list[tuple]:
    """Issue 50's: batch 256 without speculation's step and host time, and the speedups over
    HOST_BASELINE (only where the run's baseline is that commit)."""
    found, rows = [], {(r["batch_size"], r["method"]): r for r in p["results"]}
    if (256, "off") in rows:
        current = rows[256, "off"]["current"]
        name = "host overhead, batch 256, no speculation"
        found.append((f"{name}: step time", current["wall_s"] * 1e3, HOST_STEP_MS, " ms", "<="))
        found.append((f"{name}: host time per sequence", current["host_s"] / 256 * 1e6,
                      HOST_US_PER_SEQ, " µs", "<="))  # fmt: skip
    baseline = p["trees"].get("baseline", {}).get("commit", "")
    for b, method, least in HOST_SPEEDUPS * baseline.startswith(HOST_BASELINE):
        if (b, method) in rows:
            name = f"host overhead, batch {b}, {method}: step vs {baseline}"
            found.append((name, rows[b, method]["speedup"], least))
    return found


def _contention_targets(results: list[dict]) -> list[tuple]:
    rows, found = {(r["batch_size"], r["system"]): r for r in results}, []
    for b in CONTENTION_BATCHES:
        if (b, "pagedspec") not in rows:
            continue
        ours = rows[b, "pagedspec"]
        name = f"shared CPU, batch {b}: pagedspec contended / quiet"
        found.append((name, ours["contended_vs_quiet"], CONTENTION_RATIO))
        if (b, "pagedspec-fixed") in rows:
            quiet = ours["quiet_tokens_per_s"] / rows[b, "pagedspec-fixed"]["quiet_tokens_per_s"]
            found.append((f"shared CPU, batch {b}: quiet, pagedspec / fixed threads", quiet,
                          CONTENTION_QUIET))  # fmt: skip
    return found


def _targets_table(payloads: list[dict]) -> list[str]:
    rows = [t | {"verdict": ("MISS", "PASS")[t["passed"]]} for p in payloads for t in targets(p)]
    rows = [r | {"shown": None if r["value"] is None else r["unit"]} for r in rows]
    columns = "target={name} | measured={value:.2f}{shown} | threshold={op} {threshold}{unit} | "
    columns += "=**{verdict}**"
    if not any(r["bound"] is not None for r in rows):  # only the llama.cpp targets have one
        return ["## Targets", "", *_table(columns, rows), ""] if rows else []
    columns += " | run ceiling / peer={bound:.2fx}"
    note = (
        "Last column: the run ceiling (the throughput sections' last column) over the peer's "
        "tokens/s, the ratio an engine with no cost but its matmuls would reach at the measured "
        "read bandwidth and GEMM rate (torch's matmul; for int8 and q4_1 weights the faster of "
        "it and their own kernel's, no library running their numerics). Those are measurements, "
        "not the hardware's limits (a GEMV can read faster than torch's sum), so this estimates "
        "what is within reach; it proves nothing."
    )
    return ["## Targets", "", *_table(columns, rows), "", note, ""]


def section(payload: dict, file: str) -> str:
    """One benchmark's targets and section, as the benchmark prints them when it is done."""
    lines = _targets_table([payload]) + RENDERERS[payload["benchmark"]](payload | {"_file": file})
    return "\n".join(lines).replace("{results}", ".")


def render(results_dir: Path, output: Path) -> str:
    """RESULTS.md's text for the JSON files in ``results_dir``, links relative to ``output``."""
    payloads = []
    for path in sorted(results_dir.glob("*.json")):
        p = json.loads(path.read_text())
        # block_manager.json carried no name before: its file's says it.
        p |= {"benchmark": p.get("benchmark", path.stem), "_file": path.name}
        payloads += [p] if p["benchmark"] in RENDERERS else []
    if not payloads:
        raise ValueError(f"no benchmark JSON files in {results_dir}")
    payloads.sort(key=lambda p: NAMES.index(p["benchmark"]))
    rerun = ("`make bench` reruns the CPU sweep (`python -m benchmarks.run_all`) and regenerates "
             "this page." if results_dir.name == "results" else "`benchmarks/gpu_check.sh` on a "
             "lent GPU wrote them (README, \"GPU check\").")  # fmt: skip
    lines = ["# Benchmark results", "", "Generated by `python -m benchmarks.report` from the JSON "
             f"files in `{results_dir}`; do not edit by hand. {rerun}", "",
             *_targets_table(payloads)]  # fmt: skip
    for p in payloads:
        lines += RENDERERS[p["benchmark"]](p)
    link = Path(os.path.relpath(results_dir, output.parent)).as_posix()
    return "\n".join(lines).replace("{results}", link) + "\n"


if __name__ == "__main__":
    # python -m benchmarks.report [RESULTS_DIR OUTPUT]: the GPU check's JSON renders the same way
    # (benchmarks/results-gpu -> benchmarks/RESULTS-GPU.md, README "GPU check").
    import sys

    results, out = map(Path, sys.argv[1:3] or ("benchmarks/results", "benchmarks/RESULTS.md"))
    out.write_text(render(results, out))
