"""Command line of the server. The engine flags are generated from ``EngineConfig`` and
``SpeculativeConfig`` fields, so a new config field gets its flag without anyone listing it."""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, dataclass, fields

from pagedspec.engine.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    METHOD_DEFAULTS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
    SpeculativeConfig,
)
from pagedspec.engine.entrypoints.generate import (
    NUM_THREADS_HELP,
    HelpFormatter,
    checked_engine_config,
    checked_speculative_config,
    from_options,
)

API_KEY_ENV = "PAGEDSPEC_API_KEY"
CHOICES = {
    "attention_backend": ATTENTION_BACKENDS,
    "load_format": ("auto", "dummy"),
    "scheduling_policy": SCHEDULING_POLICIES,
    "method": SPECULATIVE_METHODS,
    "quantization": tuple(q for q in QUANTIZATIONS if q),
    "kv_cache_dtype": KV_CACHE_DTYPES,
}
HELP = {
    "model": "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)",
    "dtype": "auto, float32, bfloat16 or float16",
    "device": "auto, cpu, cuda or cuda:N",
    "num_kv_blocks": "KV cache blocks (default: sized from free memory)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "longest sequence (default: the model's context length)",
    "seed": "engine seed (unseeded requests)",
    "num_threads": NUM_THREADS_HELP,
    "scheduling_policy": "fcfs, or priority: by each request's priority (lower first), "
    "preempting the lowest first",
    "quantization": "weight-only quantisation, CPU float32 (int8: Q8_0, q4_1: Q4_1; default none)",
    "kv_cache_memory": "bytes for the KV cache when --num-kv-blocks is not given",
    "kv_cache_dtype": "KV cache dtype: auto (the model's), or float16/bfloat16 under a float32 "
    "model",
    "method": "speculative decoding method; off when not given",
    "draft_model": "draft model (draft) or EAGLE head directory (eagle)",
    "num_speculative_tokens": "most drafts per sequence per step",
    "ngram_min": "shortest n-gram the n-gram proposer matches",
    "ngram_max": "longest n-gram the n-gram proposer matches",
    "disable_batch_size": "no speculation in steps with this many sequences running or waiting",
    "disable_tree_batch_size": "no draft-tree leaves (chains only) in steps with this many "
    "sequences running or waiting",
    "max_draft_skip": "most steps a sequence skips drafting after a failed round",
    "sample_drafts": "draft models sample drafts at temperature > 0 (else argmax)",
    "min_draft_confidence": "stop a draft chain below this product of top-1 draft probabilities",
    "draft_leaves": "eagle: draft-tree leaves verified beside the chain (0: chains only, the "
    "default under xformers)",
}
SKIPPED = {"speculative_config"}  # set through the SpeculativeConfig flags
DEFAULTS = {"method": None}  # speculation is off unless --speculative-method is given


@dataclass(frozen=True)
class ServerArgs:
    host: str
    port: int
    api_key: str | None
    served_model_name: str
    max_queue: int
    shutdown_timeout: float
    log_level: str
    engine: EngineConfig


def method_defaults_text(name: str) -> str:
    """A SpeculativeConfig field's per-method default (pagedspec.engine.config.METHOD_DEFAULTS) as
    --help shows it: "16, 4 for eagle"."""
    methods_of: dict[float, list[str]] = {}
    for method, defaults in METHOD_DEFAULTS.items():
        methods_of.setdefault(defaults[name], []).append(method)
    (most, _), *others = sorted(methods_of.items(), key=lambda item: -len(item[1]))
    return ", ".join([f"{most:g}"] + [f"{v:g} for {' and '.join(m)}" for v, m in others])


def speculative_dest(name: str) -> str:
    """``method`` → ``speculative_method``; names that already say draft/speculative stay."""
    return name if "speculative" in name or "draft" in name else f"speculative_{name}"


def _add_field(group: argparse._ArgumentGroup, f: Field, hint: object, dest: str) -> None:
    flag = "--" + dest.replace("_", "-")
    default = DEFAULTS.get(f.name, None if f.default is MISSING else f.default)
    help_text = HELP.get(f.name, f.name.replace("_", " "))
    if f.name in METHOD_DEFAULTS["ngram"]:
        help_text += f" (default: {method_defaults_text(f.name)})"
    if hint is bool:
        group.add_argument(
            flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text
        )
        return
    scalar = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)][0]
    group.add_argument(
        flag,
        dest=dest,
        type=scalar,
        default=default,
        choices=CHOICES.get(f.name),
        help=help_text,
    )


def _add_config_flags(
    parser: argparse.ArgumentParser, cls: type, title: str, dest_of: typing.Callable[[str], str]
) -> dict[str, str]:
    """One flag per field of ``cls``; returns {field: argparse dest}."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    options = {}
    for f in fields(cls):
        if f.name in SKIPPED:
            continue
        dest = dest_of(f.name)
        _add_field(group, f, hints[f.name], dest)
        options[f.name] = dest
    return options


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str], dict[str, str]]:
    """The parser, and the engine and speculation {field: dest} maps."""
    p = argparse.ArgumentParser(
        prog="pagedspec serve",
        description="OpenAI-compatible HTTP server for pagedspec.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model_path", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's serve MODEL)"
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
    )
    s.add_argument(
        "--served-model-name", help="model name clients send (default: the model's folder name)"
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="most requests waiting to be scheduled; more are answered 503 with Retry-After",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM drains (new requests get 503, running ones go on) before it "
        "aborts what is left",
    )
    s.add_argument("--log-level", default="info", help="uvicorn log level")
    engine = _add_config_flags(p, EngineConfig, "engine", lambda name: name)
    spec = _add_config_flags(p, SpeculativeConfig, "speculative decoding", speculative_dest)
    return p, engine, spec


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and check everything before the model loads; ValueError names the bad flag."""
    parser, engine_options, spec_options = build_parser()
    args = parser.parse_args(argv)
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ValueError(f"--model: {args.model!r} and MODEL {args.model_path!r} disagree")
        args.model = args.model_path
    if args.max_queue < 1:  # 0 would refuse every request (each waits until the next step)
        raise ValueError(f"--max-queue must be an integer >= 1, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    spec = None
    if args.speculative_method is not None:
        spec = from_options(
            checked_speculative_config,
            spec_options,
            args,
            attention_backend=args.attention_backend,
        )
    engine = from_options(checked_engine_config, engine_options, args, speculative_config=spec)
    return ServerArgs(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name or default_served_name(engine.model),
        max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        engine=engine,
    )


def default_served_name(model: str | None) -> str:
    if model is None:
        from pagedspec.engine.loader.default_model import (
            GGUF_NAME,  # (imports torch: after the flags)
        )

        return GGUF_NAME.split(".")[0]
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
