#!/usr/bin/env bash
# Every GPU check of this project as ONE command of at most 10 minutes on a GPU host: the
# steps run in priority order under one deadline (default 560 s, setup included; give the
# command 600 s); a step that
# would not fit in the time left is skipped and reported, never cut short at the end.
#
#   bash bench/gpu_prepare.sh              # first, on a machine with network: fills .gpu/
#   bash bench/gpu_session.sh              # on the GPU host, from the repository root
#   bash bench/gpu_session.sh --dry-run    # on CPU: every step in --quick mode (CI runs this)
#
# The GPU host needs no network: .gpu/whl holds the transformers and fla-core wheels, each
# checked for by name (the host
# has torch, triton and the project's other dependencies); the reference fixtures come with the
# checkout (benchlib/paths.py). Files land in $OUT (default /tmp/clef-gpu-out), five at most:
# the summary h200-YYYY-MM-DD-summary.json (fields in benchlib/gpu_steps.py, null where a step
# did not run), steps.jsonl (each step's status, time and result), logs.txt, env.txt (the
# host and the versions, or the import that failed) and kernel-cache.tar.gz (the compiled
# kernels and autotune results, keyed by GPU, Triton and torch: copy it to .gpu/ to seed the
# next sitting; a first-sitting triton-autotune.tar there seeds too). Missing wheels or a
# failed `import fla` run no step, but still leave
# env.txt and a summary whose `error` says why. CLEF_COMMIT, when the launcher sets it, is the
# commit the summary records. The steps, their limits and the summary are
# benchlib/gpu_steps.py; DEADLINE (seconds) overrides the deadline, SCRATCH the steps' own folder.
set -u
export PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
# The dry run: the same plan on a CPU host, limits and deadline doubled (benchlib/gpu_steps.py).
if [ $DRY = 1 ]; then DEADLINE=${DEADLINE:-1120}; else DEADLINE=${DEADLINE:-560}; fi
OUT=${OUT:-/tmp/clef-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
: > "$OUT/env.txt"
cd "$(dirname "$0")/.."
ERROR=""
if [ $DRY = 1 ]; then
  PY=${PYTHON:-python3}
  FLAGS=(--dry-run)
  SCRATCH=$(mktemp -d)
else
  PY=python3
  FLAGS=()
  SCRATCH=${SCRATCH:-/tmp/clef-gpu-steps}
  # Both wheels, by name: one of them alone installs and then fails at the first import.
  MISSING=""
  for WHEEL in transformers fla_core; do
    compgen -G ".gpu/whl/$WHEEL-*.whl" > /dev/null || MISSING="$MISSING $WHEEL-*.whl"
  done
  if [ -n "$MISSING" ]; then
    ERROR="missing in .gpu/whl:$MISSING: run bench/gpu_prepare.sh before the sitting"
  elif ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .gpu/whl/*.whl >> "$OUT/env.txt" 2>&1; then
    ERROR="installing the wheels of .gpu/whl failed (env.txt)"
  fi
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv \
    >> "$OUT/env.txt" 2>&1
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
# Each version on its own line, or the import's error, so one missing module names itself.
"$PY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "transformers", "triton", "fla"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "FAILED:", type(exc).__name__, exc)
try:
    import torch
    print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
except Exception as exc:
    print("device", "FAILED:", exc)
EOF
# fla is the GPU path's (the dry run's quick steps run the torch path on CPU).
if [ $DRY = 0 ] && [ -z "$ERROR" ] && grep -q "^fla FAILED" "$OUT/env.txt"; then
  ERROR="import fla failed: $(grep '^fla FAILED' "$OUT/env.txt" | head -1)"
fi
cat "$OUT/env.txt"
[ -n "$ERROR" ] && FLAGS+=(--error "$ERROR")
exec "$PY" -m benchlib.gpu_steps ${FLAGS[@]+"${FLAGS[@]}"} --out "$OUT" --scratch "$SCRATCH" \
  --deadline $((DEADLINE - SECONDS))
