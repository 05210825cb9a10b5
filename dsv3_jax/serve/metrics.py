"""Prometheus metrics of the server, in their own registry (so several apps in one process never clash).

Owns: metric names, help texts, labels and histogram buckets. The names are vLLM's (`vllm:*`, with a
`model_name` label) wherever vLLM has one, so its dashboards and alerts work unchanged; what vLLM has no
name for keeps a `dsv3_` name (engine compiles, mean batch, MTP acceptance). The HTTP side (app.py)
counts requests, tokens and latencies as clients see them, and every HTTP answer by status
(`http_requests_total`, 4xx and 5xx included); the engine thread (runner.py) counts preemptions, queue
time and draft tokens. Gauges that describe the engine now (running, waiting, KV usage) are read at
scrape time from the runner (`bind_engine`), so they are true when idle. The MTP metrics exist only when
MTP is on. prometheus-client objects are thread-safe, so both threads write directly.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds, up to 30 minutes (a long reasoning answer under load).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 600.0, 1200.0, 1800.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))  # 1 .. 500K tokens


class Metrics:
    """The server's metrics for one served model (`model_name`, the first --served-model-name)."""

    def __init__(self, model_name: str = "dsv3-default", *, spec_decode: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*m, *labels], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self._request_success = counter("vllm:request_success", "Finished requests, by finish reason",
                                        ("finished_reason",))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests").labels(
            model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated").labels(model_name)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache").labels(model_name)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache").labels(model_name)
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (pages taken back)").labels(
            model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Request arrival to first token sent",
                         _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens received",
                        _ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (tokens - 1)", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request arrival to last token", _LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Submission to the engine step that admitted the request", _LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request",
                                          _TOKEN_BUCKETS)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Generated tokens per request", _TOKEN_BUCKETS)
        self.http = Counter("http_requests", "HTTP answers by route, method and status",
                            ["handler", "method", "status"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", m,
                             registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission", m,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages held (0..1)", m,
                              registry=r).labels(model_name)
        self.batch_size = Gauge("dsv3_batch_size", "Mean sequences per engine step (recent window; 0 idle)",
                                m, registry=r).labels(model_name)
        self.prefill_pending = Gauge("dsv3_prefill_tokens_pending", "Prompt tokens not yet prefilled, "
                                     "running and waiting requests (a long prompt's progress)", m,
                                     registry=r).labels(model_name)
        self.compiles = Gauge("dsv3_engine_compiles", "Step programs compiled since start (warmup included)",
                              m, registry=r).labels(model_name)
        self.compiles_after_warmup = Gauge("dsv3_engine_compiles_after_warmup",
                                           "Step programs compiled while serving (0 after a full warmup)", m,
                                           registry=r).labels(model_name)
        self.spec_decode = spec_decode
        if spec_decode:  # absent (not 0) without MTP: "no drafts" is not "no draft accepted"
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "MTP draft tokens proposed"
                                        ).labels(model_name)
            self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "MTP draft tokens accepted"
                                           ).labels(model_name)
            self.mtp_acceptance = Gauge("dsv3_mtp_acceptance_rate", "Accepted / proposed MTP draft tokens "
                                        "(since start)", m, registry=r).labels(model_name)

    def request_finished(self, finished_reason: str) -> None:
        """One request done: `finished_reason` stop | length | abort | error (vLLM's first three)."""
        self._request_success.labels(self.model_name, finished_reason).inc()

    def bind_engine(self, running: Callable[[], float], waiting: Callable[[], float],
                    kv_usage: Callable[[], float]) -> None:
        """Read these gauges from the engine at scrape time (true when idle, never a stale last value)."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
