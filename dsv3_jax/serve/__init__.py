"""The OpenAI-compatible HTTP server (`python -m dsv3_jax.serve`).

`app` (routes, SSE, the one HTTP status mapping), `protocol` (strict wire schemas), `parsers` (reasoning
and V3.1 tool-call parsing of the output text), `runner` (the engine thread: feeds each request's
stream, admission bound), `metrics` (Prometheus). Must not hold model math or engine scheduling
(engine/), nor resolve sampling parameters itself (request_stream.py).
"""
