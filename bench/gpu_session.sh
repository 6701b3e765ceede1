#!/usr/bin/env bash
# One GPU lease, one script: every device check of this project, most important first
# (latency and throughput, then parity; the guide says a lent GPU goes to those first).
# Run through the device tool from the repo root with `.gpu` carried, which
# `bash bench/gpu_prepare.sh` fills here first:
#   .gpu/whl/      transformers 5.24.0 and fla-core 0.6.0 wheels (the image has torch, triton,
#                  pytest, hypothesis and the project's other dependencies)
#   .gpu/fixtures/ a copy of ../shared/fixtures (../shared does not travel; the script links it
#                  there for the tests)
# Each step has its own time limit and writes its JSON under $OUT as it finishes; the sum of the
# limits of the steps before `--- optional` fits a 15-minute lease with the machine's start.
#
#   bash bench/gpu_session.sh              # on the GPU host
#   bash bench/gpu_session.sh --dry-run    # here, on CPU: every step with --quick, no install
# One device command may run 10 minutes at most and the required steps' limits add up to 775 s,
# so a lease runs it in two calls (each under 600 s; the machine's start, a minute or two, comes
# out of the same 15 minutes):
#   STEPS='^flash_(path_cold|warmup_cached|profile)' bash bench/gpu_session.sh  # 1-2b, <= 520 s
#   STEPS='^(graphs_unit|short_conv_unit|parity_bf16)' bash bench/gpu_session.sh  # 3-4, <= 255 s
set -u
export PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ $DRY = 1 ]; then
  PY=${PYTHON:-python3}; F=${FIXTURES:-../shared/fixtures}; DEV=cpu
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  PY=python3; F=.gpu/fixtures; DEV=cuda
  [ -e ../shared/fixtures ] || { mkdir -p ../shared && ln -s "$PWD/.gpu/fixtures" ../shared/fixtures; }
fi
FAILED=0
step() { local name=$1 limit=$2; shift 2
  [[ $name =~ ${STEPS:-.} ]] || return 0  # STEPS: a regex of the step names this call runs
  echo "=== $name"; local t0=$SECONDS
  echo "=== $name" >> "$OUT/logs.txt"
  local cmd=("$@")  # dry run: --quick right after the script (before any `--` and its flags)
  if [ $DRY = 1 ] && [[ "${cmd[1]:-}" == bench/*.py ]]; then cmd=("${cmd[@]:0:2}" --quick "${cmd[@]:2}"); fi
  timeout "$limit" "${cmd[@]}" > "$OUT/step.out" 2>> "$OUT/logs.txt"; local rc=$?
  [ $rc = 0 ] || FAILED=$((FAILED+1))
  "$PY" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "rc": int(sys.argv[2]), "seconds": int(sys.argv[3]), "stdout": open(sys.argv[4]).read()[-20000:]}))' \
    "$name" "$rc" "$((SECONDS-t0))" "$OUT/step.out" >> "$OUT/results.jsonl"
  echo "rc=$rc ${name} $((SECONDS-t0))s"; tail -c 1200 "$OUT/step.out"; echo; }
if [ $DRY = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import sys, torch, transformers, fla, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, fla.__version__, triton.__version__, torch.cuda.get_device_name())"
fi
# 1. Clef-Flash shapes: warm-up (cold Triton cache), graph memory, latency by length
#    150/370/1000/2000/7000/16000, fresh-length sweep, batched throughput C1/C4/C16/C32,
#    graphs vs eager answers (argmax, |dprob|)
export TRITON_CACHE_DIR=/tmp/triton-cold
step flash_path_cold 330 "$PY" bench/bench_gpu_path.py --device $DEV --gdn-prefill fla --out "$OUT/flash_path.json"
# 2. warm-up again with the Triton cache the previous step left on disk
step flash_warmup_cached 100 "$PY" bench/bench_gpu_path.py --device $DEV --gdn-prefill fla --modes graphs --lengths 370 --concurrency 1 --fresh 0 --repeat 5 --out "$OUT/flash_warmup_cached.json"
# 2b. the profile summary: device idle share, launches per request, top kernels, eager vs graphs
step flash_profile 90 "$PY" bench/bench_gpu_profile.py --device $DEV --gdn-prefill fla --modes eager graphs --out "$OUT/flash_profile.json"
# 3. graphs replay what eager computes (the capture unit test runs only where CUDA is)
step graphs_unit 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py -k cuda
# 3b. fla's Triton short convolution vs transformers' torch one at Clef-Flash's width, bf16, and
#     captured in a graph (skips without CUDA + fla; one autotune of 16 configs, unmeasured)
step short_conv_unit 45 "$PY" -m pytest -q -p no:cacheprovider tests/test_short_conv_cuda.py
# 4. parity with the golden answers in bf16 (fla), eager vs graphs
step parity_bf16_fla_eager 60 "$PY" bench/gpu_parity.py --fixtures $F --device $DEV --dtype bfloat16 --gdn-prefill fla --cuda-graphs off
step parity_bf16_fla_graphs 90 "$PY" bench/gpu_parity.py --fixtures $F --device $DEV --dtype bfloat16 --gdn-prefill fla --cuda-graphs on
echo "--- optional (if the lease has time left)"
# 5. parity in float32 (torch Gated DeltaNet; exact float32 parity is already pinned on CPU in CI)
step parity_fp32_torch_eager 60 "$PY" bench/gpu_parity.py --fixtures $F --device $DEV --dtype float32 --gdn-prefill torch --cuda-graphs off
step parity_fp32_torch_graphs 90 "$PY" bench/gpu_parity.py --fixtures $F --device $DEV --dtype float32 --gdn-prefill torch --cuda-graphs on
# 6. batching through a real worker process (demo snapshot): C1 vs C4/C16/C32 batched/unbatched
step worker_batching_demo 90 "$PY" bench/bench_worker_batching.py --model demo --device $DEV --requests 192 --rounds 1 --concurrency 4 16 32
step http_demo_cuda_batched 100 "$PY" bench/bench_http.py --requests 200 --clients 16 -- --model demo --device $DEV --max-batch 16
step flash_torch_gdn 100 "$PY" bench/bench_flash_shaped.py --device $DEV --gdn-prefill torch --skip-warmup-probe --repeat 8 --out "$OUT/flash-shaped-torch.json"
echo "=== done ($FAILED failed)"
[ $FAILED = 0 ]
