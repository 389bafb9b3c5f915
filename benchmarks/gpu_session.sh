#!/usr/bin/env bash
# GPU checks and timings in device calls that each fit the 10-minute limit, writing results
# under $OUT (or ./gpu-out). From the repository root on the GPU machine:
#   source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_session.sh parity
#   source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_session.sh bench   (bench-kda: KDA prefill)
# Each part has its own time limit, so one slow compile cannot take the rest down.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export FNATTN_CHECKS=0
part() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | tail -25; }
case "${1:-}" in
  parity)  # FlashInfer compiles each kernel variant on first use: most of this time
    part 330 env FNATTN_GPU_RESULTS="$out/full_attention_parity.json" python -m pytest -q -p no:warnings \
        --tb=line tests/gpu/test_full_backends_gpu.py
    part 240 env FNATTN_GPU_RESULTS="$out/recurrent_parity.json" python -m pytest -q -p no:warnings \
        --tb=line tests/gpu/test_recurrent_backends_gpu.py tests/gpu/test_speculative_gpu.py
    ;;
  bench)
    part 150 python -m fnattn bench decode --batch 1 8 64 --layers 1 8 --out "$out/bench_decode_layers.json"
    part 80 python -m fnattn bench gdn-decode --out "$out/bench_gdn_decode.json"
    part 70 python -m fnattn bench gdn-decode-sweep --out "$out/bench_gdn_decode_sweep.json"
    part 90 python -m fnattn bench prefill --tokens 16384 --out "$out/bench_prefill.json"
    part 120 python -m fnattn bench gdn-prefill --out "$out/bench_gdn_prefill.json"
    ;;
  bench-kda)
    part 90 python -m fnattn bench kda-prefill --out "$out/bench_kda_prefill.json"
    ;;
  *)
    echo "usage: gpu_session.sh parity|bench|bench-kda" >&2
    exit 2
    ;;
esac
