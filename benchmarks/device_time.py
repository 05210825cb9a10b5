"""GPU time of back-to-back calls, read from the profilers instead of the host clock (GPU only).

Owns the two measurements the kernel benchmarks quote beside their wall-clock figures:
- `jax_device_time(fn, args)`: runs `calls` back-to-back calls of a jitted `fn` under `jax.profiler`, then
  reads every kernel of the device plane's stream lines from the trace. Per call it sums all kernels (the
  Pallas kernel and XLA's small ops around it), so host dispatch gaps between kernels are not counted
  (at 0.05-0.1 ms a call those gaps are most of a wall-clock figure).
- `torch_device_time(fn)`: the same for a torch peer, from `torch.profiler`'s CUDA kernel events.
Both return median / min / max of the per-call sums in ms. Sustained back-to-back calls keep the clock
throttling of a loaded GPU in the figure, as a serving step would see it.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile

import jax


def _summary(per_call_ns: list[float], kernels: dict[str, list[float]]) -> dict:
    """Per-call sums (median/min/max, ms); per kernel name its median launch (`kernels`), and per call its
    total time and launch count (`kernel_totals`: what a profile table of one call shows)."""
    ms = [t / 1e6 for t in per_call_ns]
    calls = len(per_call_ns)
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms),
                kernels={k: round(statistics.median(v) / 1e6, 5) for k, v in kernels.items()},
                kernel_totals={k: {"ms_per_call": sum(v) / calls / 1e6, "launches_per_call": len(v) / calls}
                               for k, v in kernels.items()})


def _split_calls(events: list[tuple[int, int, str]], calls: int) -> tuple[list[float], dict[str, list[float]]]:
    """Kernel events (start, duration, name), sorted, as `calls` equal runs of kernels; per call the sum."""
    events.sort()
    if not events or len(events) % calls:
        raise RuntimeError(f"{len(events)} kernel events do not split into {calls} calls: "
                           f"{sorted({e[2] for e in events})[:8]}")
    per = len(events) // calls
    sums, kernels = [], {}
    for c in range(calls):
        chunk = events[c * per:(c + 1) * per]
        sums.append(float(sum(d for _, d, _ in chunk)))
        for _, d, n in chunk:
            kernels.setdefault(n, []).append(float(d))
    return sums, kernels


def jax_device_time(fn, args, calls: int = 20) -> dict:
    """GPU time per call of `fn(*args)` (jitted), from a `jax.profiler` trace of `calls` back-to-back calls."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        data = ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):  # per-stream kernel lines; "XLA Ops" etc. repeat them
                events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    return _summary(*_split_calls(events, calls))


def torch_device_time(fn, calls: int = 20) -> dict:
    """GPU time per call of a torch `fn()`, from `torch.profiler`'s kernel events over `calls` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [(int(e.time_range.start * 1e3), int(e.time_range.elapsed_us() * 1e3), e.name)
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return _summary(*_split_calls(events, calls))
