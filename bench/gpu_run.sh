#!/usr/bin/env bash
# The one script a GPU machine runs, from the repository root: installs nsp into the machine's Python (which
# already has jax with CUDA), runs nsp's GPU tests where there are any, then bench/gpu_step.py. Everything it
# produces goes to $OUT (default ./gpu_out): the record gpu_step.json, the portable-ISA params check
# gpu_step_portable.json, and a log of each part. About 8 minutes at most; each part has its own time limit, and
# a part that fails does not stop the next.
#
#   OUT=/some/dir bash bench/gpu_run.sh
#
# Limits (seconds) can be changed through the environment: INSTALL_TIMEOUT (240), TESTS_TIMEOUT (90),
# BENCH_TIMEOUT (330, with the benchmark's own --time-budget-s BENCH_BUDGET, 270), CHECK_TIMEOUT (60).
# For a dry run elsewhere: SKIP_INSTALL=1 (nsp already installed), BENCH_ARGS="--quick", PYTHON=<interpreter>.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
START=$(date +%s)
stamp() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
summary="$OUT/gpu_run_summary.txt"
: > "$summary"
note() { stamp "$*" | tee -a "$summary"; }

if [ -z "${NSP_SOURCE_COMMIT:-}" ] && command -v git >/dev/null 2>&1; then
  NSP_SOURCE_COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"
  [ -n "$NSP_SOURCE_COMMIT" ] || unset NSP_SOURCE_COMMIT
fi
export NSP_SOURCE_COMMIT 2>/dev/null || true

note "python: $($PY -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' \
  2>&1 | tail -1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1 || true

# 1. Install nsp (builds its C++ extension). Without network the build requirements must already be there: try
#    without build isolation first (the machine's scikit-build-core, nanobind and jax), then the ordinary way.
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if [ -n "${SKIP_INSTALL:-}" ]; then
  note "install: skipped (SKIP_INSTALL)"
else
stamp "pip install -e . (log: $OUT/pip_install.log)"
if timeout "${INSTALL_TIMEOUT:-240}" $PY -m pip install -q --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1; then
  note "install: ok (no build isolation)"
else
  echo "--- retrying with build isolation" >> "$OUT/pip_install.log"
  if timeout "${INSTALL_TIMEOUT:-240}" $PY -m pip install -q -e . >> "$OUT/pip_install.log" 2>&1; then
    note "install: ok"
  else
    note "install: FAILED (tail of the log below); going on with whatever nsp is importable"
    tail -n 30 "$OUT/pip_install.log" | tee -a "$summary"
  fi
fi
fi
$PY -c 'import nsp.primitives as p; print("nsp imports; kernel ISA", p.kernel_isa())' 2>&1 | tail -3 | tee -a "$summary"

# 2. nsp's GPU tests, where there are any.
gpu_tests=()
for t in tests/test_cuda_handler.py tests/test_gpu.py; do
  [ -f "$t" ] && gpu_tests+=("$t")
done
if [ ${#gpu_tests[@]} -gt 0 ]; then
  stamp "pytest ${gpu_tests[*]} (log: $OUT/gpu_tests.log)"
  timeout -k 10 "${TESTS_TIMEOUT:-90}" $PY -m pytest -q -x -p no:cacheprovider "${gpu_tests[@]}" \
    > "$OUT/gpu_tests.log" 2>&1
  note "gpu tests: exit $? ($(tail -n 1 "$OUT/gpu_tests.log"))"
else
  note "gpu tests: none in this tree"
fi

# 3. The benchmark: its record is rewritten after every part, so a timeout still leaves what it measured.
stamp "bench/gpu_step.py (log: $OUT/gpu_step.log)"
timeout -k 20 "${BENCH_TIMEOUT:-330}" $PY -u bench/gpu_step.py --out "$OUT/gpu_step.json" \
  --time-budget-s "${BENCH_BUDGET:-270}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_step.log"
note "gpu_step: exit ${PIPESTATUS[0]}"

# 4. The params check once more under the portable kernels (there it must hold bit for bit), if time is left.
left=$(( 450 - ($(date +%s) - START) ))
if [ "$left" -gt 45 ]; then
  stamp "params check with NSP_KERNEL_ISA=portable (log: $OUT/gpu_step_portable.log)"
  NSP_KERNEL_ISA=portable timeout -k 10 "${CHECK_TIMEOUT:-60}" $PY -u bench/gpu_step.py --check-only \
    --out "$OUT/gpu_step_portable.json" > "$OUT/gpu_step_portable.log" 2>&1
  rc=$?
  note "portable params check: exit $rc ($(grep -m1 'params check: same' "$OUT/gpu_step_portable.log" | cut -c1-200))"
else
  note "portable params check: skipped (${left}s left of the 450s this script allows itself)"
fi
note "done in $(( $(date +%s) - START ))s"
cat "$summary"
