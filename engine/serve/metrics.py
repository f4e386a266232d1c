"""Prometheus metrics, named after vLLM's ``vllm:`` ones with our own ``pagedspec:`` prefix.

Engine state (queues, KV blocks, prefix cache, speculation) is read from the engine thread's
latest ``EngineStats`` when scraped; token totals and latencies are recorded per request by the
handlers. Each server has its own registry (no process-global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedspec.engine.outputs import EngineStats

PREFIX = "pagedspec:"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class EngineStatsCollector:
    """Gauges and counters computed from the latest ``EngineStats`` at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        used = s.num_total_blocks - s.num_free_blocks
        yield _gauge("num_requests_running", "Sequences running in the engine.", s.num_running)
        yield _gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield _gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            used / s.num_total_blocks if s.num_total_blocks else 0.0,
        )
        yield _gauge("kv_cache_used_blocks", "KV cache blocks held by sequences.", used)
        yield _gauge("kv_cache_total_blocks", "KV cache blocks in the pool.", s.num_total_blocks)
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.num_prefix_cache_query_tokens,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.num_prefix_cache_hit_tokens,
        )
        yield _counter("num_preemptions", "Sequences preempted (recomputed).", s.num_preemptions)
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens)
        yield _counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens
        )


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        # No `_created` series beside each counter and histogram (vLLM turns them off too):
        # prometheus_client's switch for it is process-wide.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats))
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prefill tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.requests = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests answered with an error, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output chunks.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency.")

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)
