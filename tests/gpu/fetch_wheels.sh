#!/usr/bin/env bash
# Fetch what the device check needs beyond the GPU image's own Python packages, as wheels for its
# CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git; carried with the check, installed there by
# run_on_device.sh into a scratch --target). The image has torch, CuPy, transformers, numpy and
# pytest but no pydantic stack: fastserve.worker.spec needs annotated-types (at our lock's version).
#
#     bash tests/gpu/fetch_wheels.sh        # then carry .whl with the check
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
PY="${PYTHON:-python3}"
WHEELS=("annotated-types==0.8.0")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
