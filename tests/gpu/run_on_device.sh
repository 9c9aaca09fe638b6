#!/usr/bin/env bash
# The one-call device check (issue #25): environment, the GPU tests, then the measurements against
# the hardware's limits. No Ray needed; runs under the device image's python3 from the repo root:
#
#     bash tests/gpu/run_on_device.sh            # logs and the JSON under $OUT (or ./gpu-check-out)
#
# Budget: ~2 minutes on one H200 as measured (pytest ~1 min, the benchmark ~40 s; each under its own
# timeout, and each test under 90 s, so one hang cannot eat the lease). The last line printed is
# bench_gpu's JSON object.
#
# The device image has torch, CuPy and transformers but neither Ray nor pydantic; `fastserve.worker.spec`
# imports `annotated_types`. Download wheels for Python 3.12 into an ignored `.whl/` (annotated-types
# at our lock's version; transformers at our pin, so the parity tests compare against the version
# CI uses), carry `.whl`, and install them first:
#
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#         && export PYTHONPATH=/tmp/site && bash tests/gpu/run_on_device.sh
#
# The tracked tree must stay under the tool's 64 MiB: move `results/` aside for the call.
set -u
# Time limits (s): the whole pytest run, one test, the benchmark.
PYTEST_LIMIT_S=240 TEST_LIMIT_S=90 BENCH_LIMIT_S=200
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
  echo "== environment"; date -u; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  "$PY" -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable"
  # Ray's NCCL channels (a GPU pipeline's compiled graph) need CuPy's NCCL binding to load libnccl
  # (after torch, as in a stage worker: torch's wheel brings libnccl.so.2).
  "$PY" -c "import torch, cupy.cuda.nccl as n; print('cupy.cuda.nccl available', n.available)" \
    || echo "cupy.cuda.nccl: not importable"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

echo "== pytest tests/gpu"
timeout "$PYTEST_LIMIT_S" "$PY" -m pytest -q -p no:cacheprovider --timeout="$TEST_LIMIT_S" tests/gpu -rs --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.txt" | tail -25
PYTEST_RC=${PIPESTATUS[0]}
echo "pytest exit status: $PYTEST_RC"

echo "== fastserve.bench.bench_gpu"
timeout "$BENCH_LIMIT_S" "$PY" -m fastserve.bench.bench_gpu 2>&1 | tee "$OUT/bench_gpu.txt"
BENCH_RC=${PIPESTATUS[0]}
tail -1 "$OUT/bench_gpu.txt" > "$OUT/bench_gpu.json"
echo "pytest=$PYTEST_RC bench=$BENCH_RC"
tail -1 "$OUT/bench_gpu.txt"
exit $(( PYTEST_RC != 0 || BENCH_RC != 0 ))
