#!/usr/bin/env bash
# One device call that checks and times everything GPU-side, writing results under $OUT
# (or ./gpu-out). Run from the repository root on the GPU machine:
#   source .gpu/install.sh; FNATTN_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_session.sh
# Each part has its own time limit, so one slow compile cannot take the rest down.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export FNATTN_CHECKS=0
part() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | tail -25; }
part 240 env FNATTN_GPU_RESULTS="$out/recurrent_parity.json" python -m pytest -q -p no:warnings --tb=line \
    tests/gpu/test_recurrent_backends_gpu.py
part 90 python -m fnattn bench gdn-decode --out "$out/bench_gdn_decode.json"
part 120 python -m fnattn bench gdn-prefill --out "$out/bench_gdn_prefill.json"
part 60 python -m fnattn bench kda-prefill --out "$out/bench_kda_prefill.json"
part 150 python -m fnattn bench decode --batch 1 8 64 --layers 1 8 --out "$out/bench_decode_layers.json"
