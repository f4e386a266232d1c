"""Decode-step cost with the one-call C++ decoder stack on and off (engine/models/layer_stack.py).

One process, one engine: greedy requests of ``--batch-size`` prompts alternate between the
stack and the Python layer loop, so both see the same machine load. Every ``engine.step()``
after a request's first (its prefill) is timed in thread CPU time (one thread by default: all the
work then runs on this thread, and CPU time is what a loaded machine perturbs least) and wall
time; min and median per side, and whether both sides generated the same tokens.
"""

import argparse
import time

import torch

from benchmarks.timing import percentile
from pagedspec import LLM, SamplingParams
from pagedspec.engine.models.layer_stack import LayerStack

PROMPT = "Tell me a long story about a dragon who lives in a cave near the sea and"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "int8", "q4_1"), default="int8")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4, help="timed runs per side")
    parser.add_argument("--threads", type=int, default=1)
    return parser


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{"stack" | "python": {cpu_min_ms, cpu_p50_ms, wall_min_ms, wall_p50_ms}, "same_tokens"}."""
    torch.set_num_threads(args.threads)
    kwargs = {
        "fp32": {},
        "bf16": {"dtype": "bfloat16"},
        "int8": {"quantization": "int8"},
        "q4_1": {"quantization": "q4_1"},
    }
    llm = LLM(args.model, **kwargs[args.precision])
    engine, model = llm.llm_engine, llm.llm_engine.runner.model.model
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times = {side: ([], []) for side in ("stack", "python")}
    tokens: dict[str, list] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for side, (cpu, wall) in times.items():
            model.layer_stack = LayerStack() if side == "stack" else None
            ids = [f"{side}-{repeat}-{i}" for i in range(args.batch_size)]
            for i, request_id in enumerate(ids):
                engine.add_request(request_id, PROMPT + " and" * i, params)
            out, prefill = {}, True
            while engine.has_unfinished_requests():
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                outputs = engine.step()
                if repeat and not prefill:
                    cpu.append(1000 * (time.thread_time() - cpu0))
                    wall.append(1000 * (time.perf_counter() - wall0))
                prefill = False
                out.update({o.request_id[len(side) :]: o.outputs[0].token_ids for o in outputs})
            tokens[side] = sorted(out.items())
    result: dict = {"same_tokens": tokens["stack"] == tokens["python"]}
    for side, (cpu, wall) in times.items():
        result[side] = {
            "cpu_min_ms": min(cpu),
            "cpu_p50_ms": percentile(cpu, 50),
            "wall_min_ms": min(wall),
            "wall_p50_ms": percentile(wall, 50),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(f"{args.precision}, batch {args.batch_size}, {args.threads} thread(s), ms per step:")
    for side in ("stack", "python"):
        r = result[side]
        print(
            f"  {side:6s} cpu min {r['cpu_min_ms']:.2f} p50 {r['cpu_p50_ms']:.2f}"
            f" | wall min {r['wall_min_ms']:.2f} p50 {r['wall_p50_ms']:.2f}"
        )
    print(f"  same tokens: {result['same_tokens']}")


if __name__ == "__main__":
    main()
