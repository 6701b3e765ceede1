#!/usr/bin/env bash
# Here, before a GPU lease: fill .gpu/ (gitignored) with what bench/gpu_session.sh needs there.
# The H200 image holds torch, triton, pytest, hypothesis and this project's other dependencies
# (/work/.library/device/KINDS.md lists them), but an older transformers and no fla; nothing can
# be fetched there. Both wheels are pure Python, so any platform tags do.
#
#   bash bench/gpu_prepare.sh          # then carry .gpu in every device call
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .gpu/whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl transformers==5.24.0 fla-core==0.6.0
rm -rf .gpu/fixtures
cp -r ../shared/fixtures .gpu/fixtures
ls .gpu/whl
du -sh .gpu
