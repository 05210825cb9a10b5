"""Long context in the engine: the prefill-attention cap that keeps decoders' steps short while a long
prompt prefills (scheduler.py), the incremental prefix-cache hashes a long prefill publishes, and the
GPU script benchmarks/long_context.py run end to end at toy sizes (its stallparts task too, whose
attention call is also lowered for Hopper at the GPU run's shapes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3_jax.engine.paging import PagePool, page_hashes
from dsv3_jax.engine.scheduler import Request, Scheduler, attention_pairs, chunk_tokens_within


def _brute_pairs(start: int, n: int) -> int:
    return sum(start + t + 1 for t in range(n))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200_000), st.integers(0, 10**8))
def test_chunk_tokens_within_is_the_largest_chunk_under_the_cap(start, pairs):
    n = chunk_tokens_within(start, pairs)
    assert attention_pairs(start, n) <= pairs < attention_pairs(start, n + 1)
    if n < 50:
        assert attention_pairs(start, n) == _brute_pairs(start, n)


def _request(rid: int, prompt_len: int, new: int) -> Request:
    rng = np.random.default_rng(rid)
    return Request(rid, rng.integers(2, 200, prompt_len).tolist(), new, 0.0, 1.0, 0, 0, frozenset())


def _drive(sched: Scheduler, steps: int) -> list[list[tuple[Request, object]]]:
    """Run the schedule without a device: each row's tokens count as computed, a final row emits one
    token (what core.Engine does, pipelining off)."""
    plans = []
    for _ in range(steps):
        plan, starved = sched.schedule()
        assert not starved
        for r, row in plan:
            r.computed += row.n
            if row.final:
                r.output.append(7)
        for r in [r for r in sched.running if len(r.output) >= r.max_new_tokens]:
            sched.remove(r)
        plans.append(plan)
    return plans


@pytest.mark.parametrize("cap", [0, 4096, 40_000])
def test_a_long_prefill_beside_decoders_stays_under_the_attention_cap(cap):
    pool = PagePool(num_pages=1 + 8 * 4 + 64, page_size=16, prefix_caching=False)
    sched = Scheduler(pool, max_batch=16, max_batched_tokens=512, chunk_size=256, spec_k=0, num_slots=16,
                      prefill_attention_pairs=cap)
    decoders = [_request(i, 20, 200) for i in range(4)]
    sched.waiting.extend(decoders)
    _drive(sched, 2)  # the short prompts prefill and start decoding
    assert all(r.output for r in decoders)
    long = _request(99, 900, 1)
    sched.waiting.append(long)
    plans = _drive(sched, 400)
    assert long.output, "the long prompt must finish its prefill"
    chunks = [(row.start, row.n) for plan in plans for r, row in plan if r is long]
    assert sum(n for _, n in chunks) == 900
    decoding = [plan for plan in plans if any(r is long for r, _ in plan)]
    # Every step of the long prefill also decoded all four short requests.
    assert all(sum(1 for r, row in plan if row.n == 1 and r is not long) == 4 for plan in decoding)
    if cap:
        # Each chunk attends at most the cap (at least 1 token: the prefill always progresses).
        assert all(attention_pairs(s, n) <= cap or n == 1 for s, n in chunks)
        # Deeper chunks are shorter: the cap, not chunk_size, sets them past the first.
        assert chunks[-1][1] < chunks[0][1] <= 256
        assert len(chunks) >= 900 * 900 // 2 // cap
    else:
        assert [n for _, n in chunks] == [256, 256, 256, 132]


def test_without_decoders_a_long_prompt_takes_whole_chunks():
    pool = PagePool(num_pages=1 + 64, page_size=16, prefix_caching=False)
    sched = Scheduler(pool, max_batch=4, max_batched_tokens=512, chunk_size=256, spec_k=0, num_slots=4,
                      prefill_attention_pairs=1000)
    long = _request(1, 900, 1)
    sched.waiting.append(long)
    plans = _drive(sched, 4)
    assert [row.n for plan in plans for _, row in plan] == [256, 256, 256, 132]
    with pytest.raises(ValueError, match="prefill_attention_pairs"):
        Scheduler(pool, max_batch=4, max_batched_tokens=512, chunk_size=256, spec_k=0, num_slots=4,
                  prefill_attention_pairs=-1)


def test_page_hashes_extend_the_known_chain():
    toks = list(range(1000))
    whole = page_hashes(toks, 16)
    assert page_hashes(toks, 16, whole[:10]) == whole
    assert page_hashes(toks[:500], 16, whole[:3]) == whole[:31]


def test_token_slice_equals_slicing_the_whole_sequence():
    r = _request(3, 50, 10)
    r.output, r.drafts = [5, 6, 7], [8, 9]
    full = r.tokens + r.drafts
    for a in range(0, 56):
        for b in range(a, 56):
            assert r.token_slice(a, b) == full[a:b], (a, b)


def test_capped_chunks_give_the_same_tokens_through_the_engine():
    """Decoders plus a long prompt, with a tight cap (chunks of a few tokens) and without: same greedy
    tokens for everyone, and the capped run really cut the long prompt into more, smaller chunks."""
    from dsv3_jax.api import ModelHandle
    from dsv3_jax.engine.core import Engine, EngineConfig
    from tests.test_engine import CFG, _mtp_friendly_params

    handle = ModelHandle(CFG, _mtp_friendly_params(CFG, 1, 4.0))
    rng = np.random.default_rng(5)
    short = [rng.integers(2, 256, 6).tolist() for _ in range(3)]
    long = rng.integers(2, 256, 200).tolist()
    out, steps = {}, {}
    for cap in (0, 600):
        eng = Engine(handle, EngineConfig(num_pages=64, page_size=16, max_batch=4, max_batched_tokens=128,
                                          chunk_size=64, prefill_attention_pairs=cap))
        rids = [eng.add_request(p, max_new_tokens=24) for p in short]
        eng.step()
        eng.step()
        rids.append(eng.add_request(long, max_new_tokens=3))
        pending = [eng.engine_stats()["prefill_tokens_pending"]]
        while eng.has_work():
            eng.step()
            pending.append(eng.engine_stats()["prefill_tokens_pending"])
        # The long prompt's progress (what /metrics' dsv3_prefill_tokens_pending shows): 200 -> 0, never up.
        assert pending[0] == 200 and pending[-1] == 0 and all(a >= b for a, b in zip(pending, pending[1:]))
        out[cap] = [eng.finished[r].output for r in rids]
        steps[cap] = eng.stats["steps"]
    assert out[600] == out[0]
    assert steps[600] > steps[0]


def test_the_plans_concurrency_is_what_the_engine_runs_before_preempting():
    """pool_plan's `max_requests` full-length requests run at once without preemption; one more request
    (admitted while short, growing to full length) makes the engine preempt: the number is exact."""
    import jax.numpy as jnp

    from dsv3_jax import plan
    from dsv3_jax.api import ModelHandle
    from dsv3_jax.engine.core import Engine, EngineConfig
    from dsv3_jax.model import layout
    from tests.test_engine import CFG, _mtp_friendly_params

    handle = ModelHandle(CFG, _mtp_friendly_params(CFG, 1, 4.0))
    one = {"data": 1, "tensor": 1, "expert": 1}
    ps, length, prompt = 8, 48, 16
    w = plan.plan(CFG, one, dtype="fp32", device_memory="1GB", reserve=0, params_or_shapes=handle.params)
    page_b = layout.bytes_per_token(CFG, "absorbed", jnp.dtype(CFG.dtype)) * ps
    mem = w.weight_bytes_per_device + (1 + 3 * 6 + 5) * page_b  # scratch + 3 requests of 6 pages + 5 spare
    p = plan.pool_plan(CFG, one, dtype="fp32", max_model_len=length, device_memory=mem, memory_fraction=1.0,
                       page_size=ps, activation_bytes=0, cache_dtype=CFG.dtype,
                       params_or_shapes=handle.params)
    assert p.max_requests == 3 and p.pages_per_request == 6
    rng = np.random.default_rng(0)
    eng = Engine(handle, EngineConfig(num_pages=p.num_pages, page_size=ps, max_batch=4, max_batched_tokens=64,
                                      chunk_size=64, row_buckets=(4,)))
    for n in (p.max_requests, p.max_requests + 1):
        before, steps0 = eng.stats["preemptions"], eng.stats["steps"]
        done = eng.generate([rng.integers(2, 256, prompt).tolist() for _ in range(n)],
                            max_new_tokens=length - prompt)
        assert all(len(r.output) == length - prompt for r in done)
        rows = list(eng.stats["batch_sizes"])[steps0:]
        if n == p.max_requests:
            assert eng.stats["preemptions"] == before and max(rows) == n
        else:
            assert eng.stats["preemptions"] > before


def _long_context():
    """benchmarks/long_context.py as a module (it imports its neighbours from benchmarks/)."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import long_context
    finally:
        sys.path.remove(str(bench))
    return long_context


def test_long_context_benchmark_runs_end_to_end_at_toy_sizes(tmp_path):
    """benchmarks/long_context.py --tiny: every section on CPU (reference kernels), the GPU run's code."""
    import json

    long_context = _long_context()
    out = tmp_path / "lc.json"
    assert long_context.main(["--tiny", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert not res["skipped"] and "stall_error" not in res
    assert [r["chunk"] for r in res["kernel"]] == [32, 64] and all("ours" in r for r in res["kernel"])
    assert [r["prompt"] for r in res["long"]] == [256, 512]
    for r in res["long"]:
        assert r["ttft_s"] > 0 and r["itl_ms"] > 0 and r["compute_floor_s"] > 0 and r["compiles_during"] == 0
    s = res["stall"]
    assert s["long_finished"] and s["baseline_gaps"] > 0 and s["during_gaps"] > 0
    assert s["compiles_during"] == 0
    # The step trace: every phase timed, the phases inside the wall, mixed programs during the prompt.
    # Decoding alone again after the long prompt, at the decoders' grown context.
    assert s["after_gaps"] > 0 and s["decoder_ctx_after"] > s["decode_ctx"]
    assert s["p99_during_over_p50_after"] == pytest.approx(s["itl_p99_during_ms"] / s["itl_p50_after_ms"])
    for when in ("before", "during", "after"):
        ph = s[f"step_phases_{when}"]
        assert ph["calls"] > 0 and sum(ph["programs"].values()) == ph["calls"]
        parts = sum(ph[f"{k}_ms"]["mean"] for k in long_context.StepTrace.PHASES)
        assert 0 < parts <= ph["wall_ms"]["mean"] * 1.001
    assert any(int(k.split("/")[0]) > s["decoders"] for k in s["step_phases_during"]["programs"])
    # The steps during the prompt by its prefix: buckets of an eighth, in order, every step call counted.
    by = s["step_wall_by_prefix"]
    assert [b["from"] for b in by] == sorted(b["from"] for b in by) and by[0]["from"] == 0
    assert all(b["from"] % (s["long_prompt"] // 8) == 0 and b["wall_p50_ms"] > 0 for b in by)
    assert sum(b["calls"] for b in by) == s["step_phases_during"]["calls"]
    assert s["itl_p99_during_ms"] >= s["itl_p50_during_ms"] > 0
    # The cap cut the long prompt's chunks below chunk_size while the decoders ran.
    assert s["long_chunk_tokens"]["last"] < s["chunk_size"]


def test_stallparts_runs_at_toy_sizes(tmp_path):
    """--tiny --tasks stallparts: the decode-only step and each mixed case, the attention call alone and the
    engine's step program, timed (host clock on CPU) without a full warmup; no other section runs."""
    import json

    long_context = _long_context()
    out = tmp_path / "parts.json"
    assert long_context.main(["--tiny", "--tasks", "stallparts", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "stallparts_error" not in res and not res["skipped"]
    assert "kernel" not in res and "long" not in res and "stall" not in res and "warmup" not in res
    p = res["stallparts"]
    assert p["layers"] == res["config"]["layers"] == 2
    cases = {c["case"]: c for c in p["cases"]}
    assert list(cases) == ["decode", "22@384", "1@384", "22@64"]
    for c in cases.values():
        assert "attention_error" not in c and "step_error" not in c
        assert c["attention"]["median_ms"] > 0 and c["step"]["median_ms"] > 0
        assert "added_median_ms" in c or c["case"] == "decode"
    assert cases["decode"]["rows"] == 2 and cases["decode"]["tokens"] == 2
    m = cases["22@384"]
    assert m["rows"] == 3 and m["tokens"] == 24 and m["chunk_pairs"] == 22 * 384 + 22 * 23 // 2
    # The mixed step runs the larger program, a one-token chunk still fits the decode program.
    assert m["program"][0] > cases["decode"]["program"][0] == cases["1@384"]["program"][0]
    assert {tuple(x) for x in p["programs"]} == {tuple(c["program"]) for c in p["cases"]}
    # The engine loop at the first long case: the long request admitted from the prefix cache at its
    # prefix, its chunks sized by the cap there, every step on the two programs above.
    loop = res["stallloop"]
    assert "stallloop_error" not in res and loop["prefix"] == 384 and loop["long_cached_tokens"] == 384
    assert loop["chunk_tokens"] and loop["chunk_tokens"][0] == loop["cap_chunk_at_prefix"] == 10
    assert all(1 <= c <= 10 for c in loop["chunk_tokens"])
    assert loop["long_computed_at_end"] == 384 + sum(loop["chunk_tokens"])
    assert loop["decode_only"]["calls"] >= loop["steps"] and loop["with_long"]["calls"] >= loop["steps"]
    assert loop["compiles_during"] == 0
    assert loop["with_long"]["wait_ms"]["p50"] >= 0 and loop["with_long"]["commit_ms"]["p50"] > 0
    assert {tuple(int(x) for x in k.split("/")) for k in loop["with_long"]["programs"]} <= \
        {tuple(x) for x in p["programs"]}


def test_stallparts_attention_lowers_for_hopper_at_real_shapes(monkeypatch):
    """The attention call stallparts times (`engine_attention`: the engine's per-layer MLA call), lowered for
    CUDA with the compiled Mosaic GPU kernel at the GPU run's shapes: the FP8 slice (128 heads, 512 + 64),
    its engine's page table (2,560 pages) and pool, the decode program's 40 and the mixed program's 128
    token rows, built from the same rows (a 131,072-token prefix: 2,049 pages in the long row)."""
    import functools
    import importlib

    import jax
    import jax.numpy as jnp

    from dsv3_jax.engine import step
    from dsv3_jax.model import kv_cache

    lc = _long_context()
    a = lc.parse_args(["--tasks", "stallparts", "--lengths", "131072", "--token-buckets", "128,512"])
    cfg = lc.e2e_bench.slice_config(a.moe_layers, False)
    ecfg = lc.engine_config(a)
    # The engine's step shapes and page-table width (core.Engine, executor.DeviceExecutor), nothing allocated.
    shapes = step.StepShapes.make(max_rows=ecfg.max_batch, max_tokens=ecfg.max_batched_tokens, spec_k=0,
                                  decode_rows=ecfg.row_buckets, token_caps=ecfg.token_buckets)
    width = -(-min(ecfg.num_pages - 1, kv_cache.pages_for(cfg.max_position_embeddings)) // 8) * 8
    assert width == 2560
    # Off the GPU `interpret=None` means Pallas' interpreter: lower the compiled kernel instead.
    for mod in ("mla_decode", "mla_decode_fp8"):  # the modules (the package exports functions of these names)
        monkeypatch.setattr(importlib.import_module(f"pallas_kernels.{mod}"), "resolve_interpret",
                            lambda interpret: False)
    sds = jax.ShapeDtypeStruct
    i32, bf16, h = jnp.int32, jnp.bfloat16, cfg.num_attention_heads
    stack = {"pages": sds((a.moe_layers, ecfg.num_pages, kv_cache.PAGE_SIZE, cfg.latent_dim), bf16)}
    f = jax.jit(functools.partial(lc.engine_attention, softmax_scale=cfg.softmax_scale, backend="pallas"))
    lowered = set()
    for name, rows in lc.stallparts_rows(a, cfg.vocab_size).items():
        sb = step.build(rows, spec_k=0, shapes=shapes, width=width, logprobs=False,
                        scratch_slot=ecfg.max_batch)
        if name == "22@131072":
            assert len(rows[-1].pages) == 2049 and sb.key.tokens == 128
        n = sb.key.tokens
        if n in lowered:
            continue
        text = f.trace(stack, sds((n, width), i32), sds((n,), i32), sds((n,), i32),
                       sds((n, 1, h, cfg.kv_lora_rank), bf16), sds((n, 1, h, cfg.qk_rope_head_dim), bf16),
                       sds((), i32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, f"{name}: no Mosaic GPU kernel in the lowered attention"
        lowered.add(n)
    assert lowered == {40, 128}


def test_step_trace_splits_the_wait_and_restores_the_engine():
    """StepTrace times the block on a step's outputs apart from the commit's host work, and close() leaves
    the engine's methods (and step.build) as they were, so a second trace does not count twice."""
    import jax.numpy as jnp

    long_context = _long_context()
    from dsv3_jax.engine import step as step_mod

    class Sched:
        def schedule(self):
            return []

    class Eng:
        def __init__(self):
            self.sched, self.committed = Sched(), []

        def _execute(self, batch):
            return batch

        def _commit(self, inflight):
            self.committed.append(inflight)
            return []

    eng, build = Eng(), step_mod.build
    trace = long_context.StepTrace(eng)
    trace.begin()
    eng.sched.schedule()
    eng._commit((None, [], (jnp.zeros(3), None)))
    trace._cur["clock"] = 1.0
    assert set(trace._cur) >= {"schedule", "wait", "commit"} and len(eng.committed) == 1
    trace.close()
    assert "_commit" not in vars(eng) and "_execute" not in vars(eng) and "schedule" not in vars(eng.sched)
    assert step_mod.build is build


def test_itl_gaps_leave_out_a_window():
    """The stall's ITL figures leave out the gaps that overlap the profiler's window (its start, traced
    steps and stop are slower than any step) and keep the rest in (a, b]."""
    lc = _long_context()
    times = [[0.0, 1.0, 2.0, 3.0, 10.0, 11.0], [0.5, 1.5, 2.5, 3.5, 10.5]]
    all_gaps = lc.itl_gaps(times, 0.9, 11.0)
    assert sorted(all_gaps.tolist()) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 7.0, 7.0]
    kept = lc.itl_gaps(times, 0.9, 11.0, exclude=(4.0, 9.0))  # the 7-s gaps overlap it
    assert sorted(kept.tolist()) == [1.0] * 7
    assert lc.itl_gaps(times, 100.0, 200.0).size == 0


def test_busy_and_gaps_unions_overlaps_and_names_the_idle_gaps():
    ms = 1_000_000
    events = [(0, 2 * ms, "a"), (1 * ms, 3 * ms, "b"),  # overlapping: busy 3 ms
              (3 * ms + 100_000, 4 * ms, "c"),          # a 0.1-ms gap: below the floor
              (10 * ms, 11 * ms, "d")]                   # a 6-ms gap after c
    busy, gaps = _long_context().busy_and_gaps(events)
    assert busy == 3 * ms + 900_000 + 1 * ms
    assert gaps == [(6.0, "c", "d")]
