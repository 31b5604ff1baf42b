"""vLLM's production metrics under the `opweave:` prefix, beside the server's own `opweave_...` set.

Dashboards and alerts written for vLLM (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`,
...) work on OpWeave by replacing `vllm:` with `opweave:`: every family here has vLLM's name, type,
label names (`model_name`: the served model name; `engine`: always "0", as the server has one engine
however many replica sets it runs) and histogram buckets (those of vLLM's v1 `PrometheusStatLogger`).
Values follow vLLM's meaning where OpWeave knows them, with these differences:

- running / waiting: OpWeave's engine learns of a request's first token, not of its admission into a
  batch slot, so a request counts as waiting until its first token (vLLM: until it is scheduled).
- `prompt_tokens_total` counts a request's prompt once, at its first token (the end of its prefill,
  as vLLM does); a request that ends before it (cancelled while queued) adds nothing. The server's
  own `opweave_prompt_tokens_total` counts prompts at admission instead.
- `request_success_total{finished_reason}`: OpWeave's "cancelled" (client gone, server stopping) is
  vLLM's "abort"; "stop", "length" and "error" keep their names.

Left out because OpWeave does not know the time or the figure: `request_queue_time_seconds`,
`request_prefill_time_seconds` and `request_inference_time_seconds` (no event says when a request left
the queue), `iteration_tokens_total` (the ranks report tokens per 0.25 s, not per round), the
`max_tokens`/`n` parameter histograms, LoRA, speculative decoding, multimodal and KV-connector metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "opweave:"
LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index; the server runs one engine
# OpWeave's finish reasons -> vLLM's `finished_reason` label values.
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}

# vLLM's bucket boundaries (seconds), so quantiles over either server interpolate alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets, up to the context)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """The `opweave:` families in `registry`: per-request figures from the HTTP layer (`token`,
    `finished`) and the engine's figures at scrape time (`engine_families`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, context: int):
        """`context`: the plan's context (vLLM's max_model_len), the top of the token-count buckets."""
        self.labels = (model_name, ENGINE)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, documentation, LABELS, buckets=buckets,
                             registry=registry).labels(*self.labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(PREFIX + name, documentation, LABELS, registry=registry).labels(*self.labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        success = Counter(PREFIX + "request_success", "Finished requests, by vLLM's finish reason",
                          (*LABELS, "finished_reason"), registry=registry)
        # Every reason is there from the start (at 0), as in vLLM, so rates and ratios are defined.
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISHED_REASONS.values()}
        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             ITL_BUCKETS)
        # vLLM's name for the same observations before 0.11 (deprecated there), which older dashboards query.
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between consecutive tokens of a request (vLLM's deprecated name for "
                              "inter_token_latency_seconds)", ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "A request's mean time between tokens after the first", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its end",
                             REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from a request's first token to its last", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request",
                                               buckets_1_2_5(context))
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated for each finished request",
                                                   buckets_1_2_5(context))

    def token(self, arrival: float, previous: float | None, now: float, prompt_tokens: int) -> None:
        """One token of a request arrived at `now` (times from `time.monotonic`). `previous`: the
        request's previous token's time; None when this is its first, which ends its prefill (its
        `prompt_tokens` count, and its time to first token is observed)."""
        self.generation_tokens.inc()
        if previous is None:
            self.prompt_tokens.inc(prompt_tokens)
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - previous)
            self.tpot.observe(now - previous)

    def finished(self, reason: str, arrival: float, first: float | None, last: float | None, tokens: int,
                 prompt_tokens: int, now: float) -> None:
        """A request ended at `now` with OpWeave's finish `reason`, having had `tokens` tokens (the first
        and last at `first` and `last`)."""
        self.success[FINISHED_REASONS.get(reason, "error")].inc()
        self.e2e.observe(now - arrival)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(tokens)
        if first is not None and last is not None:
            self.decode_time.observe(last - first)
            if tokens > 1:
                self.request_tpot.observe((last - first) / (tokens - 1))

    def engine_families(self, stats: dict):
        """The engine's figures (`Engine.stats()`, read at each scrape) as vLLM names them."""
        labels = list(LABELS)

        def family(kind, name: str, documentation: str, value: float):
            metric = kind(PREFIX + name, documentation, labels=labels)
            metric.add_metric(list(self.labels), value)
            return metric

        yield family(GaugeMetricFamily, "num_requests_running", "Requests generating tokens", stats["running"])
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting for their first token",
                     stats["waiting"])
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Share of the KV pages sequences hold, on the "
                     "fullest scheduling replica (1 = full)", stats.get("kv_usage", 0.0))
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     stats.get("prefix_queried", 0))
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     stats.get("prefix_hit", 0))
        yield family(CounterMetricFamily, "num_preemptions", "Requests preempted when the KV pages ran short",
                     stats.get("preemptions", 0))
