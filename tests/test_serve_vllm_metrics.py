"""vLLM's metric set under `opweave:` (opweave/serve/vllm_metrics.py) in the server's /metrics.

A live server over `serve_fixtures.FakeEngine` serves a request cancelled while queued (vLLM's
"abort"), one that stops on a stop token id and one that runs to max_tokens; /metrics, parsed with
prometheus_client's text parser, must then have each vLLM family with vLLM's type, labels and
buckets (written out below from vLLM's v1 `PrometheusStatLogger`, not imported from the module),
counters equal to the requests' token counts and the right finish reasons. The example Grafana
dashboard must parse and query only metrics that /metrics has.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request

import pytest

from serve_fixtures import FakeEngine, wait_until, write_tokenizer

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module)
openai = pytest.importorskip("openai")

from test_serve_api import serving  # noqa: E402

MODEL = "tiny"
DASHBOARD = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "grafana", "opweave-dashboard.json")

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50]  # vLLM's 1-2-5 buckets up to the fake's context of 64

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
            "request_success")
HISTOGRAMS = {"time_to_first_token_seconds": TTFT_BUCKETS, "inter_token_latency_seconds": ITL_BUCKETS,
              "time_per_output_token_seconds": ITL_BUCKETS, "request_time_per_output_token_seconds": ITL_BUCKETS,
              "e2e_request_latency_seconds": LATENCY_BUCKETS, "request_decode_time_seconds": LATENCY_BUCKETS,
              "request_prompt_tokens": TOKEN_BUCKETS, "request_generation_tokens": TOKEN_BUCKETS}
CACHE_STATS = {"prefix_queried": 48, "prefix_hit": 32, "kv_usage": 0.25, "preemptions": 2}


class CacheEngine(FakeEngine):
    """The fake engine, with the prefix-cache, KV-usage and preemption figures of the real engine's stats."""

    def stats(self) -> dict:
        return {**super().stats(), **CACHE_STATS}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from opweave.serve.tokenizer import Tokenizer

    return Tokenizer.from_folder(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def scrape(url: str) -> dict:
    """/metrics parsed by prometheus_client: family name -> family (counters without `_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=20) as resp:
        return {family.name: family for family in text_string_to_metric_families(resp.read().decode())}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    """The one sample `sample` (default: the family's name) of family `name` whose labels are
    model_name=MODEL, engine="0" and `labels` (`le="0.1"` for a bucket)."""
    ours = {"model_name": MODEL, "engine": "0", **labels}
    found = [s.value for s in families[name].samples if s.name == (sample or name) and s.labels == ours]
    assert len(found) == 1, (name, sample, labels, families[name].samples)
    return found[0]


def abandon_queued_request(url: str, engine: FakeEngine, prompt: str) -> None:
    """Sends a non-streaming completion to a paused engine and goes away: the server cancels it."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: len(engine.submitted) == 1)
        assert value(scrape(url), "opweave:num_requests_waiting") == 1
    assert wait_until(lambda: engine.cancelled == [0])


def test_vllm_families_types_labels_buckets_and_counts(tokenizer):
    engine = CacheEngine()
    with serving(engine, tokenizer) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
        engine.pause()
        aborted = tokenizer.encode("hi")
        abandon_queued_request(url, engine, "hi")
        engine.resume()
        # One request stops on a stop token id, one runs to max_tokens.
        stop_ids = tokenizer.encode("One two three four five")
        reply = FakeEngine.reply(stop_ids, 20)
        stopped = client.completions.create(model=MODEL, prompt=stop_ids, max_tokens=20,
                                            extra_body={"stop_token_ids": [reply[3]]})
        length_ids = tokenizer.encode("Hello world, how are you today?")
        capped = client.completions.create(model=MODEL, prompt=length_ids, max_tokens=6, stream=True)
        assert [c.choices[0].finish_reason for c in capped][-1] == "length"
        assert stopped.choices[0].finish_reason == "stop"
        generated = [stopped.usage.completion_tokens, 6]
        assert generated[0] > 1  # so both requests have gaps between tokens
        assert wait_until(lambda: engine.stats()["running"] == engine.stats()["waiting"] == 0)
        families = scrape(url)

    for name in GAUGES:
        assert families["opweave:" + name].type == "gauge"
    for name in COUNTERS:
        assert families["opweave:" + name].type == "counter"
    for name, buckets in HISTOGRAMS.items():
        family = families["opweave:" + name]
        assert family.type == "histogram"
        les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        assert les == [str(float(b)) for b in buckets] + ["+Inf"], name
    for family in families.values():  # every vLLM-named sample carries model_name and engine
        for s in family.samples:
            if s.name.startswith("opweave:"):
                assert (s.labels["model_name"], s.labels["engine"]) == (MODEL, "0"), s

    # The engine's figures.
    assert value(families, "opweave:num_requests_running") == value(families, "opweave:num_requests_waiting") == 0
    assert value(families, "opweave:kv_cache_usage_perc") == CACHE_STATS["kv_usage"]
    assert value(families, "opweave:prefix_cache_queries", "opweave:prefix_cache_queries_total") == 48
    assert value(families, "opweave:prefix_cache_hits", "opweave:prefix_cache_hits_total") == 32
    assert value(families, "opweave:num_preemptions", "opweave:num_preemptions_total") == 2
    # Token counters: the prompts of requests that got a first token, every generated token.
    assert value(families, "opweave:prompt_tokens", "opweave:prompt_tokens_total") == len(stop_ids) + len(length_ids)
    assert value(families, "opweave:generation_tokens", "opweave:generation_tokens_total") == sum(generated)
    reasons = {s.labels["finished_reason"]: s.value for s in families["opweave:request_success"].samples
               if s.name == "opweave:request_success_total"}
    assert reasons == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    # Histograms: counts per token or per request, and the token-count sums.
    count = {name: value(families, "opweave:" + name, f"opweave:{name}_count") for name in HISTOGRAMS}
    assert count["time_to_first_token_seconds"] == 2
    assert count["inter_token_latency_seconds"] == count["time_per_output_token_seconds"] == sum(generated) - 2
    assert count["request_time_per_output_token_seconds"] == count["request_decode_time_seconds"] == 2
    assert count["e2e_request_latency_seconds"] == count["request_prompt_tokens"] == 3
    assert count["request_generation_tokens"] == 3
    assert value(families, "opweave:request_prompt_tokens", "opweave:request_prompt_tokens_sum") == \
        len(aborted) + len(stop_ids) + len(length_ids)
    assert value(families, "opweave:request_generation_tokens", "opweave:request_generation_tokens_sum") == \
        sum(generated)
    assert value(families, "opweave:request_generation_tokens", "opweave:request_generation_tokens_bucket",
                 le="1.0") == 1  # the aborted request's 0 tokens; the others have more than 1
    # The server's own set is still there, as it was.
    for name in ("opweave_requests_running", "opweave_requests_waiting", "opweave_queue_rejections",
                 "opweave_time_to_first_token_seconds", "opweave_time_per_output_token_seconds",
                 "opweave_prompt_tokens", "opweave_generation_tokens", "opweave_requests", "opweave_request_errors",
                 "opweave_healthy", "opweave_generation_tokens_per_second", "opweave_round_seconds",
                 "opweave_prefix_cache_queries", "opweave_prefix_cache_hits", "opweave_prefix_cache_hit_rate",
                 "opweave_preemptions", "opweave_kv_cache_usage_perc"):
        assert name in families, name
    assert families["opweave_requests"].samples  # by finish_reason, OpWeave's names
    assert {s.labels["finish_reason"] for s in families["opweave_requests"].samples} == {"stop", "length",
                                                                                          "cancelled"}


def test_token_times_and_error_reason():
    """Exact observations from given times: TTFT at the first token, each gap after it, e2e at the end;
    OpWeave's "error" keeps its name and "cancelled" is vLLM's "abort"."""
    from prometheus_client.parser import text_string_to_metric_families

    from opweave.serve.metrics import Metrics

    metrics = Metrics(FakeEngine(), MODEL)
    # Binary fractions, so that no gap lands beside a bucket boundary by rounding.
    for previous, now in ((None, 0.5), (0.5, 0.625), (0.625, 0.875)):
        metrics.token(arrival=0.0, previous=previous, now=now, prompt_tokens=7)
    metrics.finished("error", 0.0, 0.5, 0.875, 3, prompt_tokens=7, now=1.0)
    metrics.finished("cancelled", 0.0, None, None, 0, prompt_tokens=4, now=2.0)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}

    def get(name, sample, **labels):
        return value(families, "opweave:" + name, "opweave:" + sample, **labels)

    assert get("time_to_first_token_seconds", "time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert get("inter_token_latency_seconds", "inter_token_latency_seconds_count") == 2
    assert get("inter_token_latency_seconds", "inter_token_latency_seconds_sum") == 0.375  # 0.125 + 0.25
    buckets = {le: get("inter_token_latency_seconds", "inter_token_latency_seconds_bucket", le=le)
               for le in ("0.1", "0.15", "0.2", "0.3", "+Inf")}
    assert buckets == {"0.1": 0, "0.15": 1, "0.2": 1, "0.3": 2, "+Inf": 2}
    assert get("time_per_output_token_seconds", "time_per_output_token_seconds_sum") == 0.375
    assert get("request_time_per_output_token_seconds", "request_time_per_output_token_seconds_sum") == 0.1875
    assert get("request_decode_time_seconds", "request_decode_time_seconds_sum") == 0.375
    assert get("e2e_request_latency_seconds", "e2e_request_latency_seconds_sum") == pytest.approx(1.0 + 2.0)
    assert get("prompt_tokens", "prompt_tokens_total") == 7  # the cancelled one never had a first token
    assert get("request_prompt_tokens", "request_prompt_tokens_sum") == 11
    assert get("request_success", "request_success_total", finished_reason="error") == 1
    assert get("request_success", "request_success_total", finished_reason="abort") == 1


def test_dashboard_queries_only_exposed_metrics(tokenizer):
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    queried = {name for expr in exprs for name in re.findall(r"opweave:[A-Za-z0-9_:]+", expr)}
    assert any("histogram_quantile" in e for e in exprs)
    for wanted in ("opweave:time_to_first_token_seconds_bucket", "opweave:inter_token_latency_seconds_bucket",
                   "opweave:e2e_request_latency_seconds_bucket", "opweave:num_requests_running",
                   "opweave:num_requests_waiting", "opweave:kv_cache_usage_perc", "opweave:prefix_cache_hits_total",
                   "opweave:num_preemptions_total", "opweave:generation_tokens_total"):
        assert wanted in queried, wanted
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        sample_names = {s.name for f in scrape(url).values() for s in f.samples}
    assert queried <= sample_names, queried - sample_names
    for p in dashboard["panels"]:  # a dashboard written for vLLM: the same panels with `vllm:` work here
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"]
