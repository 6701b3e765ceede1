#!/usr/bin/env bash
# Before running bench/gpu_session.sh on a GPU host without network: fill .gpu/ (gitignored)
# with what it needs there. The host is expected to hold torch, triton, pytest, hypothesis and
# this project's other dependencies, but not transformers 5.24.0 nor fla-core; both wheels are
# pure Python, so any platform tags do. The reference fixtures travel with the checkout
# (tests/fixtures, benchlib/paths.py). The commit is recorded for the summary (the host's copy
# of the checkout may have no git history): CLEF_COMMIT when the launcher sets it, else this
# project's own HEAD when the project is its own git checkout (never the HEAD of a repository
# that merely contains it), else "unknown".
#
# With SITTINGS=<the folder that keeps earlier sittings' outputs, one folder per sitting named
# so that it sorts by date>, the newest sitting's kernel cache is copied to .gpu/ as the next
# sitting's seed: its kernel-cache.tar.gz, or, from the first sitting, its triton-autotune.tar
# (benchlib/kernel_cache_archive.py reads either; one built for another GPU, Triton or torch
# seeds nothing).
#
#   bash bench/gpu_prepare.sh          # then send .gpu along with the checkout
#   SITTINGS=/path/to/gpu-sittings bash bench/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .gpu/whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl transformers==5.24.0 fla-core==0.6.0
if [ -n "${CLEF_COMMIT:-}" ]; then
  echo "$CLEF_COMMIT"
elif [ "$(git rev-parse --show-toplevel 2>/dev/null || true)" = "$(pwd -P)" ]; then
  git rev-parse --short=12 HEAD
else
  echo unknown
fi > .gpu/COMMIT
if [ -n "${SITTINGS:-}" ]; then
  SEED=""
  for DIR in $(ls -1d "$SITTINGS"/*/ 2>/dev/null | sort); do
    for NAME in kernel-cache.tar.gz triton-autotune.tar; do
      if [ -f "$DIR$NAME" ]; then SEED="$DIR$NAME"; break; fi
    done
  done
  rm -f .gpu/kernel-cache.tar.gz .gpu/triton-autotune.tar  # an older seed must not win
  if [ -n "$SEED" ]; then cp "$SEED" .gpu/ && echo "kernel-cache seed: $SEED"; fi
fi
ls .gpu/whl
du -sh .gpu
