"""`opweave serve`: a compiled plan behind an OpenAI-compatible HTTP API (docs/serve.md).

    engine.py     the plan's ranks, started once, with continuous batching
    tokenizer.py  the checkpoint's tokenizer and chat template; tokens -> text deltas, stop strings
    protocol.py   request validation, OpenAI response and error bodies
    metrics.py    Prometheus metrics (vllm_metrics.py: vLLM's metric set under the `opweave:` prefix)
    extra.py      /tokenize, /detokenize, /version, /ping
    app.py        the FastAPI app (`make_app`) and its uvicorn runner (`run_server`)
    guard.py      HTTP hardening: Host, API key, body limits, head timeout, connection cap, generic 5xx

The HTTP modules import FastAPI, uvicorn and prometheus-client (the `serve` extra): import them
from here only when serving.
"""
