"""A small vLLM-style serving benchmark client (`vllm bench serve`'s measurements, our own code): streams
`--num-prompts` completions to an OpenAI-compatible server at a bounded concurrency (and optional Poisson
request rate), and reports per-request TTFT, inter-token latency (ITL), time per output token (TPOT),
end-to-end latency and throughput, as percentiles. Every wait is bounded (a per-request timeout and an
overall deadline); a failed request is counted, never retried.

    python benchmarks/serve_client.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16 \
        --input-len 128 --output-len 64 [--api-key KEY] [--neighbour-bytes 5000000] [--json OUT]

`--neighbour-bytes N` also sends one completion with an N-byte prompt once every concurrent stream has
`--neighbour-after` tokens past the moment all had their first (the stall test of issue 31: a stream's gaps
while the server takes the neighbour in must stay under 2x its median). Prints a short table last; `--json`
writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from typing import Any

import httpx
import numpy as np


@dataclasses.dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    gaps_s: list[float] = dataclasses.field(default_factory=list)  # between consecutive content chunks
    times_s: list[float] = dataclasses.field(default_factory=list)  # each content chunk's perf_counter
    error: str | None = None


async def stream_completion(http: httpx.AsyncClient, base_url: str, body: dict[str, Any], *,
                            headers: dict[str, str] | None = None, timeout_s: float = 120.0,
                            on_first_token: Any = None, on_token: Any = None) -> RequestResult:
    """One streamed /v1/completions request: arrival-relative chunk times, usage from the last chunk;
    `on_first_token(t)` is called when the first text arrives (at perf_counter `t`), `on_token()` on each
    text chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        res.error = obj["error"].get("message")
                        return res
                    if obj.get("usage"):
                        res.output_tokens = obj["usage"]["completion_tokens"]
                        res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    if any(c.get("text") for c in obj.get("choices", [])):
                        now = time.perf_counter()
                        res.times_s.append(now)
                        if last is None:
                            res.ttft_s = now - t0
                            if on_first_token is not None:
                                on_first_token(now)
                        else:
                            res.gaps_s.append(now - last)
                        last = now
                        if on_token is not None:
                            on_token()
        res.ok = True
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.e2e_s = time.perf_counter() - t0
    return res


def synthetic_prompts(n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (ids 1000..20000: ordinary tokens of the DeepSeek vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(input_len)] for _ in range(n)]


async def run_bench(base_url: str, *, model: str, num_prompts: int, input_len: int, output_len: int,
                    max_concurrency: int, request_rate: float = float("inf"), api_key: str | None = None,
                    neighbour_bytes: int = 0, neighbour_after: int = 8, deadline_s: float = 600.0,
                    seed: int = 0) -> dict[str, Any]:
    """Run the benchmark; returns the summary (and the per-request results under "requests")."""
    prompts = synthetic_prompts(num_prompts, input_len, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    sem = asyncio.Semaphore(max_concurrency)
    rng = np.random.default_rng(seed)
    neighbour: dict[str, Any] = {}
    flowing = asyncio.Event()  # every concurrent stream has its first token
    first, flowing_at = [0], [None]
    steady = asyncio.Event()  # every concurrent stream has `neighbour_after` tokens past that
    tokens_after: list[int] = []  # per running stream: tokens since `flowing`

    def first_token(at: float) -> None:
        first[0] += 1
        if first[0] >= min(num_prompts, max_concurrency) and not flowing.is_set():
            flowing_at[0] = at
            flowing.set()

    # The neighbour's body is built before any stream starts: serializing 5 MB on this event loop while the
    # streams run would delay this client's reading of their chunks, a gap the server did not cause.
    neighbour_body = json.dumps({"model": model, "max_tokens": 1, "prompt": (
        "All work and no play makes Jack a dull boy. " * (neighbour_bytes // 44 + 1))[:neighbour_bytes]}
    ).encode() if neighbour_bytes else b""

    limits = httpx.Limits(max_connections=max_concurrency + 2)
    # Made before any stream starts, like the neighbour's body: a client's set-up (its TLS context) holds
    # this process's GIL for 25-70 ms, which the streams' reader would count as a server gap.
    sync_http = httpx.Client(timeout=120)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
            async def one(p: list[int]) -> RequestResult:
                async with sem:
                    body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                            "ignore_eos": True}
                    slot = len(tokens_after)
                    tokens_after.append(0)

                    def on_token() -> None:
                        if flowing.is_set():
                            tokens_after[slot] += 1
                            if min(tokens_after[-min(num_prompts, max_concurrency):]) >= neighbour_after:
                                steady.set()

                    return await stream_completion(http, base_url, body, headers=headers,
                                                   on_first_token=first_token, on_token=on_token)

            async def big() -> None:
                # once the streams decode: the stall shows in their gaps, not in TTFT nor beside the step
                # after their peers' admission
                await steady.wait()
                t_send = time.perf_counter()
                r = await asyncio.to_thread(  # on a thread: writing 5 MB must not hold up this loop's reading
                    sync_http.post, base_url + "/v1/completions", content=neighbour_body,
                    headers={**(headers or {}), "Content-Type": "application/json"})
                t_done = time.perf_counter()
                neighbour.update(status=r.status_code, seconds=t_done - t_send, bytes=neighbour_bytes,
                                 sent_at_s=t_send - t0, answered_at_s=t_done - t0)

            async def main() -> list[RequestResult]:
                tasks = []
                for p in prompts:
                    tasks.append(asyncio.create_task(one(p)))
                    if request_rate != float("inf"):
                        await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
                extra = [asyncio.create_task(big())] if neighbour_bytes else []
                out = await asyncio.gather(*tasks)
                if not steady.is_set():  # the streams ended first: no neighbour
                    for e in extra:
                        e.cancel()
                await asyncio.gather(*extra, return_exceptions=True)
                return list(out)

            t0, t0_unix = time.perf_counter(), time.time()
            results = await asyncio.wait_for(main(), deadline_s)
            wall = time.perf_counter() - t0
    finally:
        sync_http.close()
    steady_from = None if flowing_at[0] is None else flowing_at[0] - t0
    for r in results:
        r.times_s = [t - t0 for t in r.times_s]
    return {**summarize(results, wall, neighbour, steady_from), "started_at_unix": t0_unix}


def _pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


SAME_STEP_S = 0.01  # the chunks one engine step produces reach this client within ~1 ms of each other


def steady_gaps(r: RequestResult, since_s: float | None) -> list[float]:
    """The request's gaps from the step that gave the last concurrent stream its first token (`since_s`, on
    the run's clock) on: every stream is decoding then. Earlier, a stream running alone sees its peers'
    admission (their prefill step, 5-7x a decode step on CPU), a cost of starting them, not of anything
    that arrives later (the neighbour is sent at `since_s`)."""
    if since_s is None:
        return list(r.gaps_s)
    return [b - a for a, b in zip(r.times_s, r.times_s[1:]) if a >= since_s - SAME_STEP_S]


def neighbour_gaps(r: RequestResult, neighbour: dict[str, Any] | None) -> list[float]:
    """The request's gaps that overlap the neighbour's time in the server (sent to answered)."""
    if not neighbour or "sent_at_s" not in neighbour:
        return []
    lo, hi = neighbour["sent_at_s"], neighbour["answered_at_s"]
    return [b - a for a, b in zip(r.times_s, r.times_s[1:]) if b > lo and a < hi]


def summarize(results: list[RequestResult], wall_s: float, neighbour: dict[str, Any] | None = None,
              steady_from_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    gaps = [g for r in ok for g in r.gaps_s]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s, "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_throughput_tok_s": out_tokens / wall_s if wall_s else 0.0,
        "request_throughput_req_s": len(ok) / wall_s if wall_s else 0.0,
        "ttft_s": _pct([r.ttft_s for r in ok if r.ttft_s is not None]), "tpot_s": _pct(tpot),
        "itl_s": _pct(gaps), "e2e_s": _pct([r.e2e_s for r in ok]),
        "max_gap_per_request_s": [max(r.gaps_s) for r in ok if r.gaps_s],
        "median_gap_per_request_s": [float(np.median(r.gaps_s)) for r in ok if r.gaps_s],
        # the same once every concurrent stream has its first token (the neighbour is sent then)
        "steady_from_s": steady_from_s,
        "steady_max_gap_per_request_s": [max(g) for r in ok if (g := steady_gaps(r, steady_from_s))],
        "steady_median_gap_per_request_s": [float(np.median(g)) for r in ok
                                            if (g := steady_gaps(r, steady_from_s))],
        # the largest gap while the neighbour is in the server
        "neighbour_max_gap_per_request_s": [max(neighbour_gaps(r, neighbour), default=0.0)
                                            for r in ok if r.gaps_s],
        "token_times_s": [[round(t, 4) for t in r.times_s] for r in ok],
        "neighbour": neighbour or None,
    }


def table(s: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    lines = [f"requests: {s['completed']} ok, {s['failed']} failed in {s['wall_s']:.2f} s; "
             f"{s['output_throughput_tok_s']:.1f} output tok/s, {s['request_throughput_req_s']:.2f} req/s",
             f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = s[k]
        lines.append(f"{k[:-2].upper():<12}" + "".join(f"{ms(v[q]):>10}" for q in ("mean", "p50", "p90", "p99",
                                                                                  "max")))
    if s.get("neighbour"):
        n = s["neighbour"]
        lines.append(f"neighbour: {n['bytes']} bytes -> HTTP {n['status']} in {n['seconds']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="dsv3-default")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all")
    p.add_argument("--api-key")
    p.add_argument("--neighbour-bytes", type=int, default=0)
    p.add_argument("--neighbour-after", type=int, default=8, help="tokens each stream decodes before it")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)
    s = asyncio.run(run_bench(a.base_url.rstrip("/"), model=a.model, num_prompts=a.num_prompts,
                              input_len=a.input_len, output_len=a.output_len, max_concurrency=a.max_concurrency,
                              request_rate=a.request_rate, api_key=a.api_key, neighbour_bytes=a.neighbour_bytes,
                              neighbour_after=a.neighbour_after,
                              deadline_s=a.deadline, seed=a.seed))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    print(table(s))
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
