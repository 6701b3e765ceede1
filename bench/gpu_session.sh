#!/usr/bin/env bash
# One GPU lease, one script: every device check of this project, most important first.
# Run through the device tool from the repo root with `.gpu` carried (wheels + fixtures copy):
#   .gpu/whl/      transformers 5.24.0 and fla-core 0.6.0 wheels (the image has torch + triton)
#   .gpu/fixtures/ a copy of ../shared/fixtures (../shared does not travel)
# Each step has its own time limit and writes its JSON under $OUT as it finishes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
F=.gpu/fixtures
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  echo "=== $name" >> "$OUT/logs.txt"
  timeout "$limit" "$@" > /tmp/step.out 2>> "$OUT/logs.txt"; local rc=$?
  python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "rc": int(sys.argv[2]), "seconds": int(sys.argv[3]), "stdout": open("/tmp/step.out").read()[-20000:]}))' \
    "$name" "$rc" "$((SECONDS-t0))" >> "$OUT/results.jsonl"
  echo "rc=$rc ${name} $((SECONDS-t0))s"; tail -c 1200 /tmp/step.out; echo; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import sys, torch, transformers, fla, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, fla.__version__, triton.__version__, torch.cuda.get_device_name())"
step parity_fp32_torch 90 python3 bench/gpu_parity.py --fixtures $F --device cuda --dtype float32 --gdn-prefill torch
step parity_bf16_fla 90 python3 bench/gpu_parity.py --fixtures $F --device cuda --dtype bfloat16 --gdn-prefill fla
step flash_fla 240 python3 bench/bench_flash_shaped.py --device cuda --gdn-prefill fla --out "$OUT/flash-shaped-fla.json"
step http_demo_cuda 100 python3 bench/bench_http.py --requests 200 -- --model demo --device cuda
step parity_bf16_torch 45 python3 bench/gpu_parity.py --fixtures $F --device cuda --dtype bfloat16 --gdn-prefill torch
step flash_torch 100 python3 bench/bench_flash_shaped.py --device cuda --gdn-prefill torch --skip-warmup-probe --repeat 8 --out "$OUT/flash-shaped-torch.json"
step flash8_fresh_lengths 200 python3 bench/bench_flash_shaped.py --device cuda --gdn-prefill fla --layers 8 --max-length 8192 --skip-warmup-probe --repeat 6 --out "$OUT/flash8-fla-fresh-lengths.json"
echo "=== done"
