"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own per app.

Per request, the HTTP layer records: time to first token (from the request's arrival), time per
output token (the request's mean gap between tokens after the first), prompt and generated token
counts, and the finish reason. The engine's own figures (requests running and waiting, queue
rejections, recent round times of every rank) are read from `engine.stats()` at each scrape.
`opweave_generation_tokens_per_second` is the generated-token rate over the last `RATE_WINDOW_S`.
Beside these, the same events feed vLLM's metric set under the `opweave:` prefix (`vllm_metrics.py`),
so dashboards written for vLLM work on OpWeave.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from opweave.serve.vllm_metrics import VllmMetrics

RATE_WINDOW_S = 10.0
# Buckets in seconds, from a sub-millisecond round on a GPU to a slow CPU prefill.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, engine, model_name: str | None = None):
        """Metrics of the server over `engine`; `model_name` (the served name, default the engine's
        model) labels the vLLM-named set."""
        self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, model_name or engine.model, engine.context)
        self.ttft = Histogram("opweave_time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("opweave_time_per_output_token_seconds",
                              "A request's mean time between output tokens after the first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("opweave_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("opweave_generation_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("opweave_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.http_errors = Counter("opweave_request_errors", "Requests refused or failed, by HTTP status",
                                   ["status"], registry=self.registry)
        self._recent: collections.deque = collections.deque()  # (time, tokens) in the rate window
        self._lock = threading.Lock()
        self.registry.register(_EngineCollector(engine, self))

    def token(self, n: int = 1, *, arrival: float | None = None, previous: float | None = None,
              now: float | None = None, prompt_tokens: int = 0) -> None:
        """`n` tokens generated. Given the request's `arrival`, this is one token of that request at
        `now`, its previous token having come at `previous` (None: this is its first, with a prompt of
        `prompt_tokens`): the vLLM-named set observes time to first token and inter-token gaps from them."""
        now = time.monotonic() if now is None else now
        self.generation_tokens.inc(n)
        with self._lock:
            self._recent.append((now, n))
        if arrival is not None:
            self.vllm.token(arrival, previous, now, prompt_tokens)

    def finished(self, reason: str, arrival: float, first: float | None, last: float | None, tokens: int,
                 prompt_tokens: int = 0, now: float | None = None) -> None:
        """One request ended (times from `time.monotonic`; `now`: when, default now)."""
        self.vllm.finished(reason, arrival, first, last, tokens, prompt_tokens,
                           time.monotonic() if now is None else now)
        self.requests.labels(reason).inc()
        if first is not None:
            self.ttft.observe(first - arrival)
            if tokens > 1 and last is not None:
                self.tpot.observe((last - first) / (tokens - 1))

    def tokens_per_second(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Figures read from the engine at scrape time."""

    def __init__(self, engine, metrics: Metrics):
        self._engine, self._metrics = engine, metrics

    def collect(self):
        stats = self._engine.stats()
        yield from self._metrics.vllm.engine_families(stats)
        yield GaugeMetricFamily("opweave_requests_running", "Requests generating tokens", value=stats["running"])
        yield GaugeMetricFamily("opweave_requests_waiting", "Requests waiting for their first token",
                                value=stats["waiting"])
        yield CounterMetricFamily("opweave_queue_rejections", "Requests refused because the queue was full",
                                  value=stats["rejected"])
        yield GaugeMetricFamily("opweave_healthy", "1 while every rank runs", value=float(bool(self._engine.healthy)))
        yield GaugeMetricFamily("opweave_generation_tokens_per_second",
                                f"Generated tokens per second over the last {RATE_WINDOW_S:g} s",
                                value=self._metrics.tokens_per_second())
        yield CounterMetricFamily("opweave_round_tokens_computed", "Token positions the rounds computed (packed "
                                  "tokens and padding tokens)", value=stats.get("tokens_computed", 0))
        yield CounterMetricFamily("opweave_round_tokens_used", "Real tokens the rounds computed (prompt chunks and "
                                  "decode steps)", value=stats.get("tokens_used", 0))
        yield CounterMetricFamily("opweave_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=stats.get("prefix_queried", 0))
        yield CounterMetricFamily("opweave_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                  "prefilled)", value=stats.get("prefix_hit", 0))
        queried = stats.get("prefix_queried", 0)
        yield GaugeMetricFamily("opweave_prefix_cache_hit_rate", "Prompt tokens found cached / looked up, since "
                                "start", value=stats.get("prefix_hit", 0) / queried if queried else 0.0)
        yield CounterMetricFamily("opweave_preemptions", "Requests preempted when the KV pages ran short (their "
                                  "prompt and outputs computed again later)", value=stats.get("preemptions", 0))
        yield GaugeMetricFamily("opweave_kv_cache_usage_perc", "Share of the KV pages sequences hold (the fullest "
                                "scheduling replica; 1 = full)", value=stats.get("kv_usage", 0.0))
        family = GaugeMetricFamily("opweave_round_seconds", "Recent round times of each rank (replica set, rank)",
                                   labels=["replica_set", "rank", "quantile"])
        for (replica_set, rank), rounds in sorted((stats.get("round_s") or {}).items()):
            if not rounds:
                continue
            ordered, labels = sorted(rounds), [str(replica_set), str(rank)]
            for q in (0.5, 0.9, 0.99):
                family.add_metric([*labels, f"{q:g}"], ordered[min(len(ordered) - 1, int(q * len(ordered)))])
            family.add_metric([*labels, "mean"], statistics.fmean(ordered))
        yield family
