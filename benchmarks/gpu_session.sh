#!/usr/bin/env bash
# One GPU session's checks, in steps that each fit one device run (10 min). Run from the repo
# root on the device machine, after the CuTe carry (../shared/device/README.md):
#   bash benchmarks/gpu_session.sh <step>      logs go to $OUT (or ./gpu_out)
# Steps: tests | checks | multi | bench (each under 10 minutes)
# Each command has its own timeout so that one hang does not take the others' output with it.
set -uo pipefail
step=${1:?step}
# At most 8 files come back from a device run: each step writes one log, and whatever the
# scripts write (JSON, charts) is packed into one tarball at the end.
final=${OUT:-gpu_out}; mkdir -p "$final"
out=$(mktemp -d); export OUT=$out
trap 'tar -C "$out" -czf "$final/$step-files.tgz" . ; cp "$out/$step.log" "$final/" 2>/dev/null' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false OPENBLAS_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ -f .device-carry/part2/unpack.sh ]] && bash .device-carry/part2/unpack.sh > "$out/unpack.log" 2>&1

t() {  # t <seconds> <command...>: appends to $step.log
  local secs=$1 log=$step.log; shift 1
  echo "### $(date -u +%H:%M:%S) $*" | tee -a "$out/$log"
  timeout "$secs" "$@" >> "$out/$log" 2>&1
  echo "### rc=$? after $*" | tee -a "$out/$log"
  tail -4 "$out/$log"
}

versions() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib, torch, triton, jax
print("torch", torch.__version__, "triton", triton.__version__, "jax", jax.__version__, "gpus", torch.cuda.device_count())
for m in ("flash_attn.cute", "cudnn", "cutlass"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "ok"))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, e)
EOF
}

case $step in
  tests)  # the whole suite on the GPUs (2-GPU tests included), parallel workers, big-offset test apart
    versions | tee "$out/versions.txt"
    t 330 python3 -m pytest -q -rs -n 8 tests --ignore=tests/test_large_offsets.py
    ;;
  checks)  # precision (and that the x16 tests see TF32), 64-bit offsets, bad values, memcheck, coarse, cuDNN
    t 60 env VSA_COARSE_PRECISION=tf32 python3 -m pytest -q -m gpu tests/test_coarse_precision.py
    t 90 python3 -m pytest -q -rs tests/test_large_offsets.py
    t 90 python3 benchmarks/safety_gpu.py
    t 120 compute-sanitizer --tool memcheck --report-api-errors no python3 benchmarks/safety_gpu.py --small \
      --frontends torch --backends triton,cute,cudnn
    t 100 env VSA_AUTOTUNE=0 python3 benchmarks/coarse_bench.py --rep-ms 50 --shapes 480p-64
    t 90 python3 benchmarks/cudnn_check.py
    ;;
  multi)  # 2 GPUs: JAX SPMD split (callback and native), host cost, Ulysses; packed sequences
    t 150 python3 benchmarks/spmd_bench.py --out "$out" --shapes small,480p-64 --reps 2
    t 100 python3 benchmarks/ulysses_bench.py --frontends torch --backends cute --iters 8 --out "$out/torch"
    t 100 python3 benchmarks/ulysses_bench.py --frontends jax --backends cute,triton --chunks 4 --iters 8 \
      --out "$out/jax"
    t 100 python3 benchmarks/varlen_bench.py --frontends torch
    ;;
  bench)  # the headline table against the peers
    t 500 python3 benchmarks/bench.py --quick --shapes 480p-64,480p-256,720p-256 --frontends eager,jax \
      --peers cudnn,fa4 --out "$out/bench"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
