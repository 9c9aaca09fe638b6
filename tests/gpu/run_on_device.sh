#!/usr/bin/env bash
# The one-call device check: environment and imports, the GPU tests, then the measurements against
# the hardware's limits (fastserve.bench.bench_gpu, one process per group of parts). No Ray needed;
# runs under the device image's python3 from the repo root:
#
#     bash tests/gpu/fetch_wheels.sh          # here, once: wheels the image lacks -> .whl/ (ignored)
#     bash tests/gpu/run_on_device.sh         # there, with .whl carried; $OUT (or ./gpu-check-out)
#     bash tests/gpu/run_on_device.sh --smoke # the rehearsal: same steps, CPU, tiny shapes
#
# Every step runs under its own timeout, capped by what is left of DEADLINE_S, and a step that fails
# or hangs does not stop the later ones. Expected on one H100: ~4 minutes (pytest ~1.5, kernels
# ~0.5, the 8B engine ~0.5, each production rank ~0.5, the host pool ~0.3).
#
# Under $OUT (4 files): check.log (everything printed), pytest.xml, bench.json (every part's
# result, the steps' exit statuses and the goals), env.txt. Printed last: the summary table, then
# one JSON object (bench.json's content).
set -u
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; fi
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu-check-out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
PY="${PYTHON:-python3}"
START=$(date +%s)
if [ "$SMOKE" = 1 ]; then DEADLINE_S=${DEADLINE_S:-400}; else DEADLINE_S=${DEADLINE_S:-540}; fi
BENCH_FLAGS=()
if [ "$SMOKE" = 1 ]; then BENCH_FLAGS=(--smoke); fi
mkdir -p "$WORK/status"

# run_step NAME LIMIT_S COMMAND...: the command under min(LIMIT_S, what is left) seconds; its exit
# status (124/137: timed out; "skipped": no time left) goes to $WORK/status/NAME, then bench.json.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped (${left}s left of ${DEADLINE_S}s)"
    echo skipped > "$WORK/status/$name"
    return
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  echo "== $name (limit ${limit}s, $(( $(date +%s) - START ))s in)"
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "$rc" > "$WORK/status/$name"
  echo "== $name: exit $rc after $(( $(date +%s) - START ))s"
}

check_env() {
  date -u; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0])
missing = []
for name in ["torch", "numpy", "cupy", "transformers", "pytest", "xdist", "pytest_timeout", "annotated_types",
             "fastserve.kernels.cupy_ops", "fastserve.worker.executor", "fastserve.bench.bench_gpu",
             "tests.harness.engine_driver"]:
    try:
        mod = importlib.import_module(name)
        print(f"import {name}: ok {getattr(mod, '__version__', '')}")
    except Exception as exc:   # report every missing piece at once
        missing.append(name)
        print(f"import {name}: MISSING ({type(exc).__name__}: {exc})")
import torch
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("missing:", missing or "nothing")
PYEOF
}

bench() {
  local name=$1 limit=$2
  shift 2
  local args=()
  for part in "$@"; do args+=(--part "$part"); done
  run_step "$name" "$limit" "$PY" -m fastserve.bench.bench_gpu "${BENCH_FLAGS[@]}" "${args[@]}" --results "$WORK"
}

main() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "== installing carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
      && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

  run_step env 60 bash -c "PY='$PY'; $(declare -f check_env); check_env" > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"

  # Tests: one worker per test file where pytest-xdist is there (the GPU is shared; the float64
  # references and NVRTC compiles run on the CPUs).
  local xdist=()
  if "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n 3 --dist loadfile); fi
  run_step pytest 170 "$PY" -m pytest -q -p no:cacheprovider --timeout=90 "${xdist[@]}" tests/gpu -rs \
    --junitxml="$OUT/pytest.xml" | tee "$WORK/pytest.txt"

  bench bench_kernels 100 ceilings attention swaps prefill
  bench bench_engine 100 engine
  bench bench_llama70b 100 llama70b_tp8
  bench bench_opt175b 100 opt175b_tp8_stage0
  bench bench_host 60 host_register

  "$PY" - "$WORK" "$(( $(date +%s) - START ))" <<'PYEOF'
import json, pathlib, sys
work, seconds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
status = {p.name: p.read_text().strip() for p in sorted((work / "status").iterdir())}
import re
summary = re.compile(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s")
lines = [l for l in (work / "pytest.txt").read_text().splitlines() if summary.search(l)]
status["pytest_summary"] = lines[-1].strip("= ") if lines else "no summary (see check.log)"
status["seconds"] = seconds
(work / "status.json").write_text(json.dumps(status))
PYEOF
  "$PY" -m fastserve.bench.bench_gpu --report "$WORK" > "$WORK/report.txt" 2>&1
  tail -1 "$WORK/report.txt" > "$OUT/bench.json"
  cat "$WORK/report.txt"
  grep -qv '^0$' "$WORK"/status/* && return 1
  return 0
}

main 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
