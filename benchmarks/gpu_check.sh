#!/usr/bin/env bash
# The GPU gate, one device call: on a bare H200 with the repo tree copied there (not pip-installed),
#   bash benchmarks/gpu_check.sh                    # or: bash benchmarks/gpu_check.sh --write-baseline
# runs, in order and each even when an earlier one failed:
#   (a) every GPU test:       python3 -m pytest -m "gpu and not experimental" tests/
#   (b) the kernel fuzz, compiled on the GPU: tests/test_kernel_fuzz.py
#   (c) the speed smoke:      benchmarks/gpu_smoke.py against benchmarks/baseline_h200.json (arguments pass through)
#   (d) a second process's warmup of the smoke's engine, from the compilation cache (c) filled
# each under its own time limit, logs in $OUT/ (else a temporary directory), then a summary of the three;
# exits non-zero when any part failed. Nothing here needs the network. Limits (seconds):
# GPU_CHECK_LIMITS="tests fuzz total" (default "270 90 560"): the smoke gets what is left of the total;
# part (d) has 40 s of its own. GPU_CHECK_PARTS (default "tests fuzz smoke cached") runs some parts only:
# on an H100 (2 test workers) the whole gate does not fit one 10-minute device call, so it is two
# calls, e.g. GPU_CHECK_PARTS="tests fuzz" GPU_CHECK_LIMITS="450 100 560", then GPU_CHECK_PARTS="smoke cached".
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# One compilation cache for this run, empty at the start: the smoke's warmup is cold, the second
# process's (part d) loads what the first compiled.
export DSV3_JAX_CACHE_DIR="${DSV3_JAX_CACHE_DIR:-$(mktemp -d -t gpu_check_xla.XXXXXX)}"
PY="${PYTHON:-python3}"
LOGS="${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$LOGS"
read -r LIM_TESTS LIM_FUZZ LIM_TOTAL <<< "${GPU_CHECK_LIMITS:-270 90 560}"
PARTS=" ${GPU_CHECK_PARTS:-tests fuzz smoke cached} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
START=$(date +%s)

names=() rcs=() secs=()
part() {  # part NAME LIMIT CMD... : run under `timeout`, output to the terminal and $LOGS/gpu_check_NAME.log
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "=== gpu_check: $name (limit ${limit} s): $*"
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$LOGS/gpu_check_$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "=== gpu_check: $name ran past its ${limit} s limit"
  names+=("$name") rcs+=("$rc") secs+=($(( $(date +%s) - t0 )))
}

# (a) Collection errors (a module importing a package absent here) must not stop the other tests.
# Experimental kernels (pallas_kernels.experimental: not the product, some fault) are left out. A test
# that hangs fails alone (pytest-timeout, in the GPU image) instead of eating the part's limit.
TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout=90)
# Up to three pytest workers (pytest-xdist, in the GPU image) share the GPU: compiles dominate the suite
# and run on the CPU cores in parallel. The largest test (the FP8 grouped GEMM at 16K rows) needs ~32 GB,
# so one worker per 36 GiB of GPU memory (3 on an H200's 139 GiB, 2 on an H100's 79 GiB at 45% = 35.8 GiB
# each: three workers at 30% of an H100 ran out of memory on 2026-12-05), each taking at most 90% / workers.
# On 2026-12-06 two H100 workers ran out of memory in the FP8-page kernel's B=128, S=32K tests (their fp32
# reference over the whole pool): the tests now build pages and the reference in blocks, and pass at 45%.
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
WORKERS=$(( ${MEM_MIB:-0} / 1024 / 36 ))
[ "$WORKERS" -gt 3 ] && WORKERS=3
[ "$WORKERS" -lt 1 ] && WORKERS=1
XDIST_ARGS=()
"$PY" -c "import xdist" 2>/dev/null && [ "$WORKERS" -gt 1 ] && XDIST_ARGS=(-n "$WORKERS")
export XLA_PYTHON_CLIENT_MEM_FRACTION=$("$PY" -c "print(round(0.9 / $WORKERS, 2))")
echo "=== gpu_check: ${MEM_MIB:-?} MiB of GPU memory: $WORKERS pytest worker(s), memory fraction $XLA_PYTHON_CLIENT_MEM_FRACTION each"
want tests && part gpu_tests "$LIM_TESTS" "$PY" -m pytest -m "gpu and not experimental" tests/ \
  -q -rfEs --durations=8 --continue-on-collection-errors "${TIMEOUT_ARGS[@]}" "${XDIST_ARGS[@]}"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
# The compiled fuzz; the ahead-of-time Hopper lowering test is a CPU test (CI runs it), not repeated here.
want fuzz && part kernel_fuzz "$LIM_FUZZ" "$PY" -m pytest tests/test_kernel_fuzz.py -q -rfEs --durations=5 "${TIMEOUT_ARGS[@]}"
LIM_SMOKE=$(( LIM_TOTAL - ($(date +%s) - START) ))
[ "$LIM_SMOKE" -lt 200 ] && LIM_SMOKE=200
PRIORS=()
for i in "${!names[@]}"; do PRIORS+=(--prior "${names[$i]}=${rcs[$i]}"); done
want smoke && part smoke "$LIM_SMOKE" "$PY" benchmarks/gpu_smoke.py "${PRIORS[@]}" "$@"
# (d) a second process start: the slice engine's warmup from the cache the smoke filled.
want cached && part cached_start 40 "$PY" benchmarks/gpu_smoke.py --skip kernels --warmup-only --out "$LOGS/gpu_smoke_cached.json"

echo
echo "=== gpu_check summary (logs in $LOGS)"
fail=0
for i in "${!names[@]}"; do
  verdict=PASS
  [ "${rcs[$i]}" -ne 0 ] && verdict=FAIL && fail=1
  [ "${names[$i]}" = smoke ] && [ "${rcs[$i]}" -eq 2 ] && verdict="FAIL (no baseline)"
  printf '%-12s %-20s exit %-4s %5s s\n' "${names[$i]}" "$verdict" "${rcs[$i]}" "${secs[$i]}"
done
exit $fail
