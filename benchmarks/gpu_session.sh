#!/usr/bin/env bash
# One GPU session's checks, in steps that each fit one device run (10 min). Run from the repo
# root on the device machine, after the CuTe carry (../shared/device/README.md):
#   bash benchmarks/gpu_session.sh <step>      logs go to $OUT (or ./gpu_out)
# Steps: tests | checks | multi | bench | stages | kernels | profile | fwd64 | merge | replay | hostprof | cudnnjax |
#   cudnnbench | pairs | pairsprof | xu | xubwd | groups | persist | wholevsa | bwdl2 | bwdlen | regs | kvpr | kvprcheck | fwdorder | fa4bwd
#   (each under 10 minutes)
#   tests: the whole suite in strict mode, and $OUT/suite_record.md (date, device, versions, commit,
#   counts, skip reasons) to commit under benchmarks/results/. Where .git did not come along, pass
#   the commit: COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_session.sh tests
# Each command has its own timeout so that one hang does not take the others' output with it.
# The script exits nonzero when a run that must fail (checks: TF32 coarse dots) does not.
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

status=0
expect_failure() {  # expect_failure <seconds> <command...>: like t, for a pytest run whose every test must fail
  local secs=$1 log=$step.log; shift 1
  echo "### $(date -u +%H:%M:%S) (every test must fail) $*" | tee -a "$out/$log"
  timeout "$secs" "$@" > "$out/expect.log" 2>&1
  local rc=$? summary
  cat "$out/expect.log" >> "$out/$log"
  summary=$(grep -E '[0-9]+ (passed|failed)' "$out/expect.log" | tail -1)
  if [[ $rc -ne 0 && $rc -ne 124 && "$summary" == *failed* && "$summary" != *passed* ]]; then
    echo "### rc=$rc as required: every test failed ($summary)" | tee -a "$out/$log"
  else
    echo "### ERROR rc=$rc ($summary): every test of this run had to fail" | tee -a "$out/$log"
    status=1
  fi
}

versions() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib, importlib.metadata as md, torch, triton, jax
print("torch", torch.__version__, "(CUDA", torch.version.cuda, ") triton", triton.__version__, "jax", jax.__version__,
      "(backend", jax.default_backend(), ") gpus", torch.cuda.device_count())
for m, dist in (("flash_attn.cute", "flash-attn-4"), ("cudnn", "nvidia-cudnn-frontend"), ("cutlass", "nvidia-cutlass-dsl")):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"), end="")
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, e, end="")
    try:
        print(f" ({dist} {md.version(dist)})")
    except md.PackageNotFoundError:
        print(f" ({dist}: no such distribution)")
EOF
}

commit() {  # the commit under test: $COMMIT from the caller (the device machine's .git copy can be stale), else git
  if [[ -n "${COMMIT:-}" ]]; then
    echo "$COMMIT (from the caller; the working tree sent with it)"
  elif git rev-parse HEAD >/dev/null 2>&1; then
    echo "$(git rev-parse HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo ' + uncommitted changes')"
  else
    echo "unknown (no .git here: run as COMMIT=\$(git rev-parse HEAD) bash benchmarks/gpu_session.sh tests)"
  fi
}

record() {  # record <log>: suite_record.md: date, device, versions, commit, counts, failures, skip reasons
  local log=$1 rec=$out/suite_record.md
  {
    echo "# GPU test suite record"
    echo
    echo "- date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    echo "- device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c | sed 's/^ *//' | paste -sd ';')"
    echo "- commit: $(commit)"
    echo "- command: VSA_REQUIRE_BACKENDS=$VSA_REQUIRE_BACKENDS python3 -m pytest -q -rfEs -n 12 --dist loadgroup tests${SHARD:+ (shard $SHARD of the files)}"
    echo "- counts: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | grep -E ' in [0-9.]+s' | tail -1 | tr -d '=' | sed 's/^ *//')"
    echo "- pytest $(grep -E '^### rc=[0-9]+ after python3 -m pytest' "$log" | tail -1 | grep -oE 'rc=[0-9]+') (124: timed out)"
    echo
    echo "## versions"
    echo '```'
    cat "$out/versions.txt"
    echo '```'
    echo
    echo "## failures"
    echo '```'
    grep -E '^(FAILED|ERROR) ' "$log" || echo "none"
    echo '```'
    echo
    echo "## skipped"
    echo '```'
    grep -E '^SKIPPED ' "$log" || echo "none"
    echo '```'
  } > "$rec"
  cp "$rec" "$final/"
  cat "$rec"
}

case $step in
  tests)  # the whole suite in strict mode (FA4, cuDNN frontend and JAX's GPU backend must be there: a
          # test that would skip for a missing one fails), 64-bit offsets included, and its record
    # SHARD=i/n: the i-th of n parts of the test files (round robin), for a suite longer than one run
    export VSA_REQUIRE_BACKENDS=cute,cudnn,sm90,jax
    versions | tee "$out/versions.txt"
    files=tests
    [[ -n "${SHARD:-}" ]] && files=$(ls tests/test_*.py | awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" '(NR - 1) % n == i - 1')
    t 575 python3 -m pytest -q -rfEs -n 12 --dist loadgroup --durations=15 $files
    record "$out/$step.log"
    ;;
  checks)  # the coarse-stage precision tests must fail with TF32 coarse dots (they pass with the
           # default in `tests`), bad values, memcheck, coarse timing, cuDNN
    expect_failure 120 env VSA_COARSE_PRECISION=tf32 python3 -m pytest -q -s -m gpu tests/test_coarse_precision.py \
      -k coarse_stage
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
  stages)  # issue 21's state: where the time goes at 480p-64, the 64-token and prefix rows against cuDNN
           # BSA and FA4, and our sm_90 64-token forward kernel (checked, then timed)
    t 120 python3 benchmarks/stage_breakdown.py --shape 480p-64 --backends triton,cudnn --out "$out"
    t 260 python3 benchmarks/bench.py --quick --shapes 480p-64,480p-64-prefix8 --frontends eager \
      --backends triton,cudnn --peers cudnn,fa4 --out "$out/bench"
    [[ -f benchmarks/sm90_fwd64_check.py ]] && t 150 python3 benchmarks/sm90_fwd64_check.py
    ;;
  kernels)  # issue 21's kernel variants against the defaults (each checked against float64, then timed)
             # and the torch eager host cost
    t 100 python3 benchmarks/host_cost.py --backends triton,cudnn,sm90,auto
    t 200 python3 benchmarks/sm90_fwd64_check.py --only=ws3L,ws3LW,k1v2L,k1v2LW --quick
    t 240 python3 benchmarks/sm90_bwd64_check.py --variants=redov,redovL,split3,split3L,split3LB
    ;;
  profile)  # issue 21/22 data: ncu of the 64-token backward (ours against cuDNN's: details and the
             # per-instruction SASS samples as text), the coarse stage's configs, the torch eager host cost
    t 240 ncu --clock-control none --profile-from-start off --set full --import-source yes -f -o "$out/bwd64" \
      python3 benchmarks/sm90_bwd64_profile.py ${PROFILE_BWD:-ours split cudnn}
    t 60 ncu -i "$out/bwd64.ncu-rep" --page details --print-units base
    t 60 sh -c "ncu -i '$out/bwd64.ncu-rep' --page source --csv --print-source sass > '$out/bwd64_sass.csv'"
    rm -f "$out/bwd64.ncu-rep"
    t 120 python3 benchmarks/coarse_sweep.py --shapes 480p-64
    t 120 python3 benchmarks/host_cost.py --backends triton,cudnn,sm90,auto
    ;;
  fwd64)  # the sm90 forward's default: its GPU tests, the whole VSA per kernel (ncu table), ours against
          # cuDNN's at top-16 (where the per-query-block cost shows), stages and the 480p-64 table
    t 150 python3 -m pytest -q -m gpu -n 8 tests/test_sm90_fwd64.py tests/test_sm90_backend.py \
      tests/test_jax_sm90_native.py tests/test_replay.py
    t 150 ncu --clock-control none --profile-from-start off --set full -f -o "$out/vsa_sm90" \
      python3 benchmarks/vsa_profile.py --backend sm90
    t 30 python3 benchmarks/vsa_profile.py --table "$out/vsa_sm90.ncu-rep"
    rm -f "$out/vsa_sm90.ncu-rep"
    t 120 ncu --clock-control none --profile-from-start off --set full -f -o "$out/fwd64_top16" \
      python3 benchmarks/sm90_fwd64_profile.py ws3L ws3LT cudnn --topk=16
    t 60 sh -c "ncu -i '$out/fwd64_top16.ncu-rep' --page details --print-units base > '$out/fwd64_top16.txt'"
    rm -f "$out/fwd64_top16.ncu-rep"
    t 100 python3 benchmarks/stage_breakdown.py --shape 480p-64 --backends sm90 --iters 5 --out "$out"
    t 120 python3 benchmarks/bench.py --quick --shapes 480p-64 --frontends eager --backends sm90,cudnn \
      --peers cudnn --out "$out/bench"
    ;;
  merge)  # before merging JAX's native default launch and the packed top-k: their GPU tests (-v: a
          # failure is named even if the run times out), the top-k kernels old against new
    t 330 env VSA_REQUIRE_BACKENDS=cute,cudnn,sm90,jax python3 -m pytest -v -rfEs -n 6 --dist loadgroup \
      tests/test_jax_native.py tests/test_jax_vsa.py tests/test_jax_sm90_native.py tests/test_shared_tiles.py \
      tests/test_import_boundaries.py tests/test_config.py tests/test_topk_select.py tests/test_prefix.py
    grep -E "FAILED|ERROR" "$out/$step.log" | head -20
    t 60 python3 benchmarks/coarse_fwd_bench.py
    ;;
  replay)  # every step backend's stages replayed (torch eager and JAX's callback): their GPU tests (-v), the
           # torch eager host cost per backend (64- and 256-token blocks), the sm90 forward by layer, and
           # 480p-256 cute on both frontends (JAX's callback replays)
    t 170 env VSA_REQUIRE_BACKENDS=cute,cudnn,sm90,jax python3 -m pytest -v -rfEs -n 6 tests/test_replay.py \
      tests/test_cudnn_backend.py::test_auto_takes_sm90_at_64_token_blocks_on_h200
    grep -E "FAILED|ERROR" "$out/$step.log" | head -20
    t 60 python3 benchmarks/host_cost.py --backends triton,cudnn,sm90,auto --layers sm90
    t 120 python3 benchmarks/host_cost.py --backends cute,triton --shape 1,2,4096,128,256,4
    t 100 python3 benchmarks/bench.py --quick --shapes 480p-256 --only vsa --frontends eager,jax --backends cute \
      --peers none --out "$out/bench"
    ;;
  hostprof)  # where the host time of a call goes: torch eager by function (cProfile: sm90, cudnn), JAX's
             # per-call cost on each launch path, and 720p-256 (cute, cudnn against cuDNN called directly)
    t 100 python3 benchmarks/host_cost.py --backends triton,cudnn,sm90,auto --calls 300 --profile sm90
    t 70 python3 benchmarks/host_cost.py --backends cudnn --calls 300 --profile cudnn
    t 120 python3 benchmarks/jax_native_bench.py
    t 240 python3 benchmarks/bench.py --quick --shapes 720p-256 --backends cute,cudnn --frontends eager \
      --peers cudnn --out "$out/bench720"
    ;;
  cudnnjax)  # the cudnn backend natively under JAX: the JAX GPU tests around it, its per-call cost
    t 440 env VSA_REQUIRE_BACKENDS=cute,cudnn,sm90,jax python3 -m pytest -v -rfEs -n 6 tests/test_jax_cudnn_call.py \
      tests/test_jax_native.py tests/test_jax_sm90_native.py tests/test_jax_vsa.py tests/test_cudnn_backend.py
    grep -E "FAILED|ERROR" "$out/$step.log" | head -20
    t 100 python3 benchmarks/jax_native_bench.py --backend cudnn --iters 200
    ;;
  pairs)  # issue 21: the forward on 2-CTA clusters (cluster_pairs: a pair's shared K/V tiles multicast)
          # against the default (ws3LT), each checked against float64, timed on random and smooth lists
    t 60 python3 -m pytest -q tests/test_pair_lists.py
    t 400 python3 benchmarks/sm90_fwd64_check.py --only=ws3LT,ws3LTrf,ws3LTC,ws3LTCrf --quick
    ;;
  xu)  # issue 21: the forward's instruction mix per opcode and per pipe, ours (ws3LT) against cuDNN's
        # (ncu), and the cluster_pairs GPU tests, once under compute-sanitizer's memcheck
    t 200 ncu --clock-control none --profile-from-start off --section InstructionStats --section WarpStateStats \
      --metrics smsp__inst_executed_pipe_xu.sum,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_uniform.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_adu.sum,smsp__inst_executed_pipe_cbu.sum,sass__inst_executed_per_opcode \
      -f -o "$out/xu" python3 benchmarks/sm90_fwd64_profile.py ws3LT cudnn
    t 60 sh -c "ncu -i '$out/xu.ncu-rep' --page raw --print-metric-instances details --print-units base > '$out/xu_raw.txt'"
    t 60 sh -c "ncu -i '$out/xu.ncu-rep' --page details --print-details all --print-units base > '$out/xu_details.txt'"
    rm -f "$out/xu.ncu-rep"
    t 120 python3 -m pytest -q -m gpu tests/test_sm90_fwd64.py -k "cluster"
    t 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_sm90_fwd64.py \
      -k "ws3-cluster-pairs and (nq4 or sq-gt-skv)"
    ;;
  xubwd)  # issue 21: the backward's instruction mix per opcode and per pipe, ours (sm90_backend.BACKWARD)
           # against cuDNN's (ncu)
    t 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section InstructionStats \
      --section WarpStateStats --section ComputeWorkloadAnalysis \
      --metrics smsp__inst_executed_pipe_xu.sum,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_uniform.sum,smsp__inst_executed_pipe_lsu.sum,sass__inst_executed_per_opcode \
      -f -o "$out/xubwd" python3 benchmarks/sm90_bwd64_profile.py backend cudnn
    t 60 sh -c "ncu -i '$out/xubwd.ncu-rep' --page raw --print-metric-instances details --print-units base > '$out/xubwd_raw.txt'"
    t 60 sh -c "ncu -i '$out/xubwd.ncu-rep' --page details --print-units base > '$out/xubwd_details.txt'"
    rm -f "$out/xubwd.ncu-rep"
    ;;
  groups)  # issue 21: the backward's query groups (each CTA one group's part of a KV block's list, the
           # partial dK / dV summed in group order): GPU tests, memcheck, A/B against the default and cuDNN
    t 200 python3 -m pytest -q -m gpu -n 4 tests/test_sm90_bwd64.py
    t 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m gpu \
      tests/test_sm90_bwd64.py -k "query_groups or (split-groups and (nq4 or long))"
    t 300 python3 benchmarks/sm90_bwd64_ab.py --rounds=${AB_ROUNDS:-4} --shapes=${AB_SHAPES:-12x39936,24x19968} \
      --calls=backend,groups,cudnn
    ;;
  persist)  # issue 21: the persistent split backward (one CTA per SM taking tiles from a counter): GPU tests,
            # memcheck of its cases, A/B against the default and cuDNN at 480p and 720p lengths
    t 150 python3 -m pytest -q -m gpu -n 4 tests/test_sm90_bwd64.py
    grep -E "FAILED|ERROR" "$out/$step.log" | head -20
    t 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m gpu \
      tests/test_sm90_bwd64.py -k "persist and (nq4 or long or list_rule)"
    t 330 python3 benchmarks/sm90_bwd64_ab.py --rounds=${AB_ROUNDS:-3} --shapes=${AB_SHAPES:-12x39936,6x75264} \
      --calls=${AB_CALLS:-backend,persist,persist20,persist10,cudnn}
    ;;
  wholevsa)  # issue 21: the whole VSA per kernel at 480p-64 (ncu table: the coarse stage's share on this
             # card), then 480p-64 and 720p-64 with the sm90 and cudnn backends against cuDNN called directly
    t 150 ncu --clock-control none --profile-from-start off -f -o "$out/vsa_sm90" \
      --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 benchmarks/vsa_profile.py --backend sm90
    t 30 python3 benchmarks/vsa_profile.py --table "$out/vsa_sm90.ncu-rep"
    rm -f "$out/vsa_sm90.ncu-rep"
    t 330 python3 benchmarks/bench.py --quick --shapes 480p-64,720p-64 --frontends eager --backends sm90,cudnn \
      --peers cudnn --out "$out/bench"
    ;;
  bwdl2)  # issue 21: the backward's L2 and DRAM traffic, ours (BACKWARD) against cuDNN's, at 480p and 720p
          # lengths (ncu, one launch each): where ours loses 1.2x at H40 S92160 but not at H12 S39936
    for shape in 12x39936 40x92160; do
      t 150 ncu --clock-control none --profile-from-start off -f -o "$out/bwdl2_$shape" --metrics \
        gpu__time_duration.sum,lts__t_sectors.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 benchmarks/sm90_bwd64_profile.py backend cudnn --shape=$shape
      t 60 sh -c "ncu -i '$out/bwdl2_$shape.ncu-rep' --page raw --csv --print-units base > '$out/bwdl2_$shape.csv'"
      rm -f "$out/bwdl2_$shape.ncu-rep"
    done
    ;;
  regs)  # issue 21: K / V in the compute warpgroups' registers (GPU tests, A/B at 480p and 720p lengths), and
         # the backward against cuDNN's between them (the auto table's length)
    t 150 python3 -m pytest -q -m gpu -n 4 tests/test_sm90_bwd64.py -k "regs"
    t 330 python3 benchmarks/sm90_bwd64_ab.py --rounds=2 --shapes=12x39936,8x58368,6x75264,40x92160 \
      --calls=backend,kvregs,cudnn
    ;;
  kvpr)  # issue 21: the backward's default (BACKWARD: head_sweep, K / V in registers, P early and rounded, L2
         # hints) and the forward's rounding residual: their GPU tests, then the backward A/B against the grid in
         # chunks (main's before), sweep alone and cuDNN
    t 200 python3 -m pytest -q -m gpu -n 4 tests/test_sm90_bwd64.py tests/test_jax_sm90_native.py tests/test_sm90_backend.py \
      tests/test_fine_residual.py tests/test_sm90_fwd64.py -k "sweep or kvpr or query_groups or backend or residual"
    t 330 python3 benchmarks/sm90_bwd64_ab.py --rounds=2 --shapes=12x39936,40x92160 --calls=chunks,sweep,kvpr,cudnn
    ;;
  fwdorder)  # issue 21: the forward with cuDNN's load order and L2 hints (q_first, v_first, consumer_k, l2_hints on
             # FORWARD = ws3LTrf): their GPU tests, then each against FORWARD and cuDNN at top-16 and top-62
    t 150 python3 -m pytest -q -m gpu -n 4 tests/test_sm90_fwd64.py -k "qvkh or consumer-k"
    t 330 python3 benchmarks/fwd64_scaling.py --topks 16,62 --rounds 2 \
      --variants ws3LTrf,ws3LTrf-q,ws3LTrf-v,ws3LTrf-k,ws3LTrf-h,ws3LTrf-qvkh,k1v2LTrf,k1v2LTrfh,ws3LPTrf
    ;;
  kvprcheck)  # issue 21: the backward's default (kvpr: head_sweep's ring of partial sums, P in bf16) and the forward's
              # rounding residual under compute-sanitizer memcheck, then the bad-list / bad-count battery on the
              # sm90 backend (64-token blocks) under memcheck, both frontends
    t 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m gpu \
      tests/test_sm90_bwd64.py tests/test_sm90_fwd64.py \
      -k "(32mib-sweep-kvpr and (nq4 or long or sq-gt)) or (list_rule and sweep-kvpr) or rounding_residual"
    t 200 compute-sanitizer --tool memcheck --report-api-errors no python3 benchmarks/safety_gpu.py --small \
      --frontends torch,jax --backends sm90 --block 64
    ;;
  fa4bwd)  # issue 21 step 4: FA4's sm_90 backward configurations for 256-token blocks (the cute backend) against
          # FA4's own choice and cuDNN's 128-token kernel; the candidates ptxas compiles clean or nearly
          # (`fa4_bwd_configs.py --cpu`, benchmarks/results/2026-12-07-session26/fa4_bwd_configs_cpu.md)
    t 400 python3 benchmarks/fa4_bwd_configs.py --only fa4,dq-swap,pds1 --shapes 720p-256,480p-256 --rounds 5
    ;;
  hostsplit)  # issue 22: a torch training step's host time split (engine, frontend backward, launches) and traced
    t 180 python3 benchmarks/host_split.py --backends triton,sm90,cudnn --ablate triton,sm90 --trace triton
    ;;
  hostprofile)  # issue 22: which of our Python lines a torch training step's host time is (cProfile, both threads)
    t 180 python3 benchmarks/host_split.py --backends triton,sm90 --calls 200 --profile triton,sm90
    ;;
  bwdlen)  # issue 21 / the auto table: our backward against cuDNN's over sequence lengths and head counts
           # (where sm90 stops being the faster backward; H4 and H40 at one length separate the two)
    t 400 python3 benchmarks/sm90_bwd64_ab.py --rounds=2 --shapes=12x39936,10x49920,8x58368,7x66816,6x75264,4x92160,40x92160 \
      --calls=backend,cudnn
    ;;
  pairsprof)  # issue 21: where the time of the forward goes, with and without the pairs' multicast (ncu)
    for lists in random smooth; do
      flag=$([[ $lists == smooth ]] && echo --smooth)
      t 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy -f -o "$out/pairs_$lists" \
        python3 benchmarks/sm90_fwd64_profile.py ws3LT ws3LTC cudnn $flag
      t 60 sh -c "ncu -i '$out/pairs_$lists.ncu-rep' --page details --print-units base > '$out/pairs_$lists.txt'"
      rm -f "$out/pairs_$lists.ncu-rep"
    done
    ;;
  cudnnbench)  # 480p-64, the cudnn and sm90 backends on both frontends against cuDNN called directly
    t 300 python3 benchmarks/bench.py --quick --shapes 480p-64 --backends cudnn,sm90 --frontends eager,jax \
      --peers cudnn --out "$out/bench"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
exit $status
