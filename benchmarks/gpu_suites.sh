#!/usr/bin/env bash
# The GPU suites (benchmarks/gpu_suites.py): each one device call that rewrites the records it names.
#   source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_suites.sh parity
#   bash benchmarks/gpu_suites.sh --list
exec python3 "$(dirname "$0")/gpu_suites.py" "$@"
