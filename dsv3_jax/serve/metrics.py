"""Prometheus metrics of the server, in their own registry (so several apps in one process never clash).

Owns: metric names, help texts and histogram buckets. The HTTP side (app.py) counts requests, tokens and
latencies as clients see them; the engine thread (runner.py) sets the engine gauges. prometheus-client
objects are thread-safe, so both write directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dsv3_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dsv3_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("dsv3_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("dsv3_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("dsv3_time_to_first_token_seconds", "Request arrival to first token sent",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dsv3_inter_token_latency_seconds", "Time between consecutive tokens received",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dsv3_request_latency_seconds", "Request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("dsv3_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("dsv3_requests_waiting", "Requests waiting for admission", registry=r)
        self.batch_size = Gauge("dsv3_batch_size", "Mean sequences per engine step (recent window)",
                                registry=r)
        self.page_usage = Gauge("dsv3_page_usage_ratio", "Fraction of KV-cache pages held", registry=r)
        self.prefix_hit_rate = Gauge("dsv3_prefix_cache_hit_rate", "Admissions that reused cached pages",
                                     registry=r)
        self.mtp_acceptance = Gauge("dsv3_mtp_acceptance_rate", "Accepted / proposed MTP draft tokens",
                                    registry=r)
        self.compiles = Gauge("dsv3_engine_compiles", "Step programs compiled since start (warmup included)",
                              registry=r)
        self.compiles_after_warmup = Gauge("dsv3_engine_compiles_after_warmup",
                                           "Step programs compiled while serving (0 after a full warmup)",
                                           registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
