#!/usr/bin/env bash
# The outer state's precision at 25M parameters on one GPU, in under 8 minutes (benchmarks/gpu_study.py):
# Adam-Decay and CGAD, naive bf16 and 8-bit m and v, heavy-tailed delays, 1008 outer steps, 5 seeds; each run's
# results.json flushed into <outdir>/runs/ as it ends, <outdir>/summary.md rewritten after every run.
#
#   bash benchmarks/gpu_study.sh <outdir>          # on a machine with one CUDA GPU
#   bash benchmarks/gpu_study.sh --cpu <outdir>    # the reduced CPU version (what the tests run)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [ "$#" -lt 1 ]; then
  echo "usage: $0 [--cpu] <outdir>" >&2
  exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "${PYTHON:-python}" "$here/gpu_study.py" "$@"
