"""Every benchmark's clock: percentiles, timed calls, and the TTFT (submission to first output
token) / TPOT (mean time per output token after the first) of a timed engine run."""

import math
import time
from collections import namedtuple
from collections.abc import Callable, Sequence

import torch

from pagedspec import LLMEngine, SamplingParams


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between the nearest ranks (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs, pos = sorted(values), (len(values) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def quantiles(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def time_calls(
    fn: Callable[[], object], iters: int, warmup: int = 1, device: torch.device | None = None
) -> list[float]:
    """Seconds of each of ``iters`` calls after ``warmup`` untimed ones (CUDA work awaited)."""
    times = []
    for _ in range(warmup + iters):
        start = time.perf_counter()
        fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def clocked(
    obj: object, name: str, keep: Callable[..., bool] = lambda *a, **k: True
) -> list[float]:
    """Wraps ``obj.name``: the seconds of each call for which ``keep(*args)`` holds are kept."""
    fn, times = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if keep(*args, **kwargs):
            times.append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)
    return times


class DeviceShare:
    """How much of each engine step the device computes: a step's wall time (the host's clock)
    beside its forwards' device time (the target's and a drafter's ``ModelRunner.forward``),
    taken by CUDA events around them on CUDA, where the host only enqueues (a forward's gaps
    while the host launches count as device time: a graph replay has none), and by the host's
    clock on the CPU, which is the device there. Sampling and everything else is host time.
    Wraps ``engine``'s methods from construction on; ``figures()`` after the run."""

    def __init__(self, engine: LLMEngine) -> None:
        self.cuda = engine.runner.device.type == "cuda"
        self.steps: list[tuple[float, list]] = []  # (wall seconds, the step's forwards' timers)
        self._open: list = []
        runners = [engine.runner, getattr(getattr(engine.spec, "proposer", None), "runner", None)]
        for runner in {id(r): r for r in runners if r is not None}.values():
            self._wrap_forward(runner)
        step = engine.step

        def timed_step():
            self._open, start = [], time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - start, self._open))
            return out

        engine.step = timed_step

    def _wrap_forward(self, runner) -> None:
        forward = runner.forward

        def timed(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                out = forward(*args, **kwargs)
                end.record()
                self._open.append((start, end))
            else:
                start = time.perf_counter()
                out = forward(*args, **kwargs)
                self._open.append(time.perf_counter() - start)
            return out

        runner.forward = timed

    def figures(self) -> dict:
        """Over the steps that ran a forward, the medians of the wall time, the device time and
        the idle share (1 - device / wall) per step."""
        if self.cuda:
            torch.cuda.synchronize()
        seconds = lambda t: t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3
        steps = [(wall, sum(map(seconds, timers))) for wall, timers in self.steps if timers]
        return {
            "step_wall_s_p50": percentile([wall for wall, _ in steps], 50),
            "step_device_s_p50": percentile([device for _, device in steps], 50),
            "device_idle_share_p50": percentile([1 - d / w for w, d in steps], 50),
        }


# Seconds after submission at which a request's first and last output token came out.
RequestTiming = namedtuple("RequestTiming", "first_token_s last_token_s num_output_tokens")
EngineRun = namedtuple("EngineRun", "timings token_ids stats")  # per request; stats over the run


def ttft_tpot(timings: Sequence[RequestTiming]) -> tuple[list[float], list[float]]:
    """The TTFT of every request and the TPOT of each that made more than one token."""
    later = [t for t in timings if t.num_output_tokens > 1]
    tpot = [(t.last_token_s - t.first_token_s) / (t.num_output_tokens - 1) for t in later]
    return [t.first_token_s for t in timings], tpot


def summarize(timings: Sequence[RequestTiming], input_tokens: int) -> dict:
    """Throughput and latency figures of one system's run over a workload (seconds)."""
    elapsed = max(t.last_token_s for t in timings)
    out_tokens = sum(t.num_output_tokens for t in timings)
    ttft, tpot = ttft_tpot(timings)
    return {
        "elapsed_s": elapsed, "num_requests": len(timings), "input_tokens": input_tokens,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + out_tokens) / elapsed,
        "requests_per_s": len(timings) / elapsed,
        "ttft_median_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
    }  # fmt: skip


def run_engine(engine: LLMEngine, requests: Sequence, ignore_eos: bool = True,
               clock=time.perf_counter, temperature: float = 0.0) -> EngineRun:  # fmt: skip
    """Submit every request (``prompt_ids``, ``output_len``) at once and step to the end;
    per-request timings by ``clock``, tokens, and the engine's stats over the run."""
    before = engine.get_stats()
    min_free, first, done = before.num_free_blocks, {}, {}
    start, steps = clock(), 0
    for i, r in enumerate(requests):
        params = dict(temperature=temperature, max_tokens=r.output_len, ignore_eos=ignore_eos)
        engine.add_request(str(i), r.prompt_ids, SamplingParams(**params))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now, steps = clock() - start, steps + 1
        min_free = min(min_free, engine.get_stats().num_free_blocks)
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)
            if tokens:
                first.setdefault(out.request_id, now)
            if out.finished:
                timing = RequestTiming(first[out.request_id], now, len(tokens))
                done[out.request_id] = (timing, tokens)
    after = engine.get_stats()
    keys = ("num_draft_tokens", "num_accepted_tokens", "num_verifications", "num_leaf_tokens")
    drafts, accepted, rounds, leaves = (getattr(after, k) - getattr(before, k) for k in keys)
    old = list(before.accepted_by_position) or [0] * len(after.accepted_by_position)
    by_position = [a - b for a, b in zip(after.accepted_by_position, old, strict=True)]
    stats = {"steps": steps, "num_kv_blocks": after.num_total_blocks,
             "peak_kv_blocks_used": after.num_total_blocks - min_free,
             "preemptions": after.num_preemptions - before.num_preemptions,
             "draft_tokens": drafts, "accepted_tokens": accepted, "verifications": rounds,
             "leaf_tokens": leaves,
             "accepted_by_position": by_position,
             "acceptance_rate": accepted / drafts if drafts else None,
             "mean_accepted_length": (accepted + rounds) / rounds if rounds else None}  # fmt: skip
    ordered = [done[str(i)] for i in range(len(requests))]
    return EngineRun([t for t, _ in ordered], [ids for _, ids in ordered], stats)
