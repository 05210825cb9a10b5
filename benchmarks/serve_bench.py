"""HTTP serving overhead: one open-loop workload through the live server and through the offline engine.

The workload: `--requests` requests with Poisson arrivals at each `--rates` value (requests/s), prompt
and output lengths drawn from a ShareGPT-like log-normal (fixed `--seed`; prompts are random token ids,
outputs exact lengths with `ignore_eos`, greedy), so both arms do the same work.
  * offline arm: an Engine with the server's EngineConfig in this process; requests are added when their
    arrival time has passed, between steps (the engine loop the server runs, without HTTP);
  * server arm: `python -m dsv3_jax.serve` as a subprocess with the same engine flags, driven by an
    asyncio client streaming `/v1/completions` (SSE parsed by hand: the client library is not measured).
Per arm and rate: output-token throughput over the makespan, TTFT and inter-token latency p50/p99 (per
token arrival at the client, resp. per engine event); the arms alternate `--repeats` times per rate and
the ratio server/offline throughput is quoted as median (min/max) over the pairs. The added latency is
measured apart, paired: `--solo` single requests, each run offline and then through the server with
nothing else in flight; the median (min/max) of the per-request TTFT and ITL differences is the HTTP
layer's cost (goals: <= 5% throughput loss, <= 2 ms added p50 TTFT). Pairing and alternation cancel most
of the drift of a shared, loaded machine. Before measuring, both arms run
a warm-up burst of other prompts: the bucket flags fix the step shapes, so every compile happens there
(not measured) and the measured prompts are in neither prefix cache. Prints a table, writes JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Fixed step shapes (both arms): the warm-up burst compiles every shape the measured passes can meet.
ENGINE_FLAGS = ["--max-batch", "16", "--num-pages", "512", "--chunk-size", "128", "--max-batched-tokens", "256",
                "--token-buckets", "16,64,256", "--row-buckets", "16"]


def workload(n: int, rate: float, seed: int, vocab: int) -> list[dict]:
    """ShareGPT-like lengths scaled to a small model on CPU: prompt median ~60 tokens (cap 512), output median
    ~24 (cap 128), both log-normal with a heavy tail; Poisson arrivals at `rate` requests/s."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    plen = np.clip(rng.lognormal(np.log(60), 0.8, n), 4, 512).astype(int)
    olen = np.clip(rng.lognormal(np.log(24), 0.7, n), 2, 128).astype(int)
    return [{"at": float(a), "prompt": rng.integers(100, vocab - 1000, p).tolist(), "max_tokens": int(o)}
            for a, p, o in zip(arrivals, plen, olen)]


def _stats(ttft: list[float], itl: list[float], tokens: int, span: float) -> dict:
    q = lambda xs, p: float(np.percentile(xs, p) * 1e3) if xs else float("nan")  # noqa: E731
    return {"tok_s": tokens / span, "span_s": span, "tokens": tokens, "ttft_p50_ms": q(ttft, 50),
            "ttft_p99_ms": q(ttft, 99), "itl_p50_ms": q(itl, 50), "itl_p99_ms": q(itl, 99)}


def _mmm(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(np.min(xs)), "max": float(np.max(xs))}


def _fmt(m: dict, digits: int = 1, sign: str = "+") -> str:
    return f"{m['median']:{sign}.{digits}f} ({m['min']:{sign}.{digits}f} / {m['max']:{sign}.{digits}f})"


def _median_arm(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


# ------------------------------------------------------------------------------------------- offline arm
def run_offline(eng, reqs: list[dict]) -> dict:
    """Replay arrivals in real time through the engine loop (add when due, step while there is work)."""
    t0 = time.perf_counter()
    todo = list(range(len(reqs)))
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    itl: list[float] = []
    rid_of: dict[int, int] = {}
    tokens = 0
    while todo or eng.has_work():
        now = time.perf_counter() - t0
        while todo and reqs[todo[0]]["at"] <= now:
            i = todo.pop(0)
            r = reqs[i]
            rid_of[eng.add_request(r["prompt"], max_new_tokens=r["max_tokens"], temperature=0.0)] = i
        if not eng.has_work():
            time.sleep(max(0.0, reqs[todo[0]]["at"] - (time.perf_counter() - t0)))
            continue
        for ev in eng.step():
            t = time.perf_counter() - t0
            i = rid_of[ev.rid]
            if ev.new_tokens:
                tokens += len(ev.new_tokens)
                if i not in first:
                    first[i] = t - reqs[i]["at"]
                else:
                    itl += [(t - last[i]) / len(ev.new_tokens)] * len(ev.new_tokens)
                last[i] = t
    span = max(last.values()) - reqs[0]["at"]
    eng.finished.clear()
    return _stats(list(first.values()), itl, tokens, span)


# -------------------------------------------------------------------------------------------- server arm
async def _one(client, base: str, model: str, r: dict, t0: float, out: dict) -> None:
    await asyncio.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
    sent = time.perf_counter() - t0
    body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    times, n = [], 0
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            k = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            if k:
                times.append((time.perf_counter() - t0, k))
                n += k
    out["ttft"].append(times[0][0] - max(sent, r["at"]))
    for (a, _), (b, k) in zip(times, times[1:]):
        out["itl"] += [(b - a) / k] * k
    out["tokens"] += n
    out["last"] = max(out["last"], times[-1][0])


async def _drive(base: str, model: str, reqs: list[dict]) -> dict:
    import httpx

    out = {"ttft": [], "itl": [], "tokens": 0, "last": 0.0}
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[_one(client, base, model, r, t0, out) for r in reqs])
    return _stats(out["ttft"], out["itl"], out["tokens"], out["last"] - reqs[0]["at"])


def start_server(port: int, log: Path) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "dsv3_jax.serve", "--port", str(port), *ENGINE_FLAGS, "--max-pending", "4096",
           "--no-warmup", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not come up in 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.5,1,2", help="request rates (requests/s), comma-separated")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--repeats", type=int, default=2, help="offline/server pairs per rate")
    p.add_argument("--solo", type=int, default=12, help="paired single requests for the added latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_bench.json")
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]

    from dsv3_jax import api
    from dsv3_jax.engine.core import Engine
    from dsv3_jax.serve.__main__ import _parser, engine_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_bench_{port}.log"
    proc = start_server(port, log)  # loads while the offline arm runs (it idles until requests come)
    base = f"http://127.0.0.1:{port}"
    try:
        handle = api.load()  # the embedded default model, as the server loads it without --ckpt
        eng = Engine(handle, engine_config(_parser().parse_args(ENGINE_FLAGS)))
        vocab = handle.config.vocab_size
        # Warm-up: a burst of other prompts reaches every fixed step shape in both arms (and leaves the
        # measured prompts out of both prefix caches).
        warm = workload(16, 50.0, args.seed + 1, vocab)
        run_offline(eng, warm)
        asyncio.run(_drive(base, "dsv3-default", warm))
        solo = []  # paired single requests: (offline, server) TTFT and ITL medians
        for r in workload(args.solo, 1.0, args.seed + 2, vocab):
            r = {**r, "at": 0.0}
            off, srv = run_offline(eng, [r]), asyncio.run(_drive(base, "dsv3-default", [r]))
            solo.append({"ttft_ms": (off["ttft_p50_ms"], srv["ttft_p50_ms"]),
                         "itl_ms": (off["itl_p50_ms"], srv["itl_p50_ms"])})
        rows = []
        for rate in rates:
            reqs = workload(args.requests, rate, args.seed, vocab)
            pairs = []
            for _ in range(args.repeats):
                off = run_offline(eng, reqs)
                srv = asyncio.run(_drive(base, "dsv3-default", reqs))
                pairs.append((off, srv))
                print(f"rate {rate}: offline {off['tok_s']:.1f} tok/s, server {srv['tok_s']:.1f} tok/s", flush=True)
            ratios = [b["tok_s"] / a["tok_s"] for a, b in pairs]
            rows.append({"rate": rate, "pairs": pairs, "throughput_ratio": _mmm(ratios),
                         "offline": _median_arm([a for a, _ in pairs]), "server": _median_arm([b for _, b in pairs])})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    added = {k: _mmm([s[k][1] - s[k][0] for s in solo]) for k in ("ttft_ms", "itl_ms")}
    result = {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "requests": args.requests, "seed": args.seed,
              "repeats": args.repeats, "engine_flags": ENGINE_FLAGS, "rows": rows, "solo": solo,
              "added_latency": added}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.solo} paired single requests, server minus offline, median (min / max): "
          f"TTFT {_fmt(added['ttft_ms'])} ms, ITL {_fmt(added['itl_ms'])} ms")
    print("\n| rate req/s | arm | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        for arm in ("offline", "server"):
            x = r[arm]
            print(f"| {r['rate']:g} | {arm} | {x['tok_s']:.0f} | {x['ttft_p50_ms']:.1f} / {x['ttft_p99_ms']:.1f} | "
                  f"{x['itl_p50_ms']:.1f} / {x['itl_p99_ms']:.1f} |")
    print("\n| rate req/s | server / offline throughput, median (min / max) over pairs |")
    print("| --- | --- |")
    for r in rows:
        print(f"| {r['rate']:g} | {_fmt(r['throughput_ratio'], 3, "")} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
