#!/usr/bin/env bash
# Every GPU check of this project as ONE command of at most 10 minutes on a GPU host: the
# steps run in priority order under one deadline (default 540 s, setup included); a step that
# would not fit in the time left is skipped and reported, never cut short at the end.
#
#   bash bench/gpu_prepare.sh              # first, on a machine with network: fills .gpu/
#   bash bench/gpu_session.sh              # on the GPU host, from the repository root
#   bash bench/gpu_session.sh --dry-run    # on CPU: every step in --quick mode (CI runs this)
#
# The GPU host needs no network: .gpu/whl holds the transformers and fla-core wheels (the host
# has torch, triton and the project's other dependencies) and .gpu/fixtures a copy of the
# reference fixtures. Files land in $OUT (default /tmp/clef-gpu-out): the summary
# h200-YYYY-MM-DD-summary.json (fields in benchlib/gpu_steps.py, null where a step did not run),
# steps.jsonl (each step's status, time and result), logs.txt and env.txt. The steps, their
# limits and the summary are benchlib/gpu_steps.py; DEADLINE (seconds) overrides the deadline.
set -u
export PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
# The dry run: the same plan on a CPU host, limits and deadline doubled (benchlib/gpu_steps.py).
if [ $DRY = 1 ]; then DEADLINE=${DEADLINE:-1080}; else DEADLINE=${DEADLINE:-540}; fi
OUT=${OUT:-/tmp/clef-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
if [ $DRY = 1 ]; then
  PY=${PYTHON:-python3}
  FLAGS=(--dry-run)
  SCRATCH=$(mktemp -d)
else
  PY=python3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  export CLEF_FIXTURES=$PWD/.gpu/fixtures
  FLAGS=()
  SCRATCH=/tmp/clef-gpu-steps
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    python3 -c "import sys, torch, transformers, fla, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, fla.__version__, triton.__version__, torch.cuda.get_device_name())"
  } 2>&1 | tee "$OUT/env.txt"
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
exec "$PY" -m benchlib.gpu_steps ${FLAGS[@]+"${FLAGS[@]}"} --out "$OUT" --scratch "$SCRATCH" \
  --deadline $((DEADLINE - SECONDS))
