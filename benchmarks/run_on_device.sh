#!/bin/bash
# One device-machine session: install, GPU tests, benchmark. Logs go to $OUT (or ./device_out).
#   source .device/setup.sh && bash benchmarks/run_on_device.sh [tests|bench|all] [bench args]
#   source .device/setup.sh && bash benchmarks/run_on_device.sh profile pro 64 [64x2]
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe    # MoE: both algorithms
#       (MOE_ALGORITHMS="mma_fp8 mma_sync" picks them; MOE_BENCH=0 leaves out bench_moe --quick)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe_detail 8 mma_sync
#       (gated-launch ablations, device-op traces of the op, Nsight Compute of one launch)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe_prefill  # prefill tiles
#       (ABLATION_TOKENS=128,256,512,1024: every kernel between decode and prefill sizes)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe_tests general|decode [K]
#       (the MoE op's GPU tests in two halves, one process; narrow with a pytest -k
#        expression K, e.g. "small", "flash and not wgmma", "pro or wgmma")
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe_tests_all
#       (every MoE GPU case, seven processes at once on the one GPU: about 8 min)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh moe_bench [bench_moe args]
#       (with the torch peer, torch._scaled_grouped_mm, from T = 512 where torch imports;
#        e.g. --shapes flash --tokens 512,4096,16384 --routings balanced --no-xla)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh model
#       (decode_step.py: decode per layer + breakdown, prefill chunks + breakdown)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh gemm_ncu wq_b 1 [ARGS]
#       (Nsight Compute of one decode GEMM launch of decode_gemms.py, the model's config, or
#        with ARGS "--row-blocks --ncu-index 1" its second variant; NCU_TAG=_x names it apart)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh op_ncu REGEX CMD...
#       (Nsight Compute of the fifth launch of a kernel matching REGEX in CMD)
#   source .device/setup.sh && bash benchmarks/run_on_device.sh prefill_ncu wgmma_fp8_coop 4096
#       (Nsight Compute of the gated launch of moe_kernel_ablation.py at T tokens under one
#        prefill algorithm, as shipped: its first launch)
#       (decode_step.py: decode per layer + breakdown, prefill chunks + breakdown)
set -u
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 DSV4_KERNEL_CACHE=/tmp/dsv4_kernels
# Install the checkout the way it is installed everywhere else: editable, no dependencies
# (the device image has them) and no build isolation (no network there; setuptools >= 64 from
# the image builds the editable wheel, which maps ffi/ kernels/ models/ checkpoints/ into
# dsv4_jax).
python3 -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
python3 -c "import jax, dsv4_jax.ffi, cutlass; print('jax', jax.__version__, jax.devices())" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [[ $what == tests || $what == all ]]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_sparse_attention.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_sparse_attention.py --markdown "$OUT/bench${BENCH_TAG:-}.md" "$@" \
    2>&1 | tee "$OUT/bench${BENCH_TAG:-}.log" | grep -v Warning
fi
if [[ $what == moe ]]; then
  # Exactness and timings of both decode algorithms, then the op benchmark (GPU tests:
  # the moe_tests mode); each step bounded so that one device call finishes them all.
  for alg in ${MOE_ALGORITHMS:-wgmma mma_sync mma_fp8}; do
    timeout ${CHECK_TIMEOUT:-150} python3 benchmarks/moe_kernel_check.py --algorithm "$alg" \
      2>&1 | grep -v Warning | tee "$OUT/moe_check_$alg.log"
  done
  [[ ${MOE_BENCH:-1} == 0 ]] || timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_moe.py --quick --tokens 1,8,64,4096 \
    --out "$OUT/bench_moe.md" 2>&1 | grep -v Warning | tee "$OUT/bench_moe.log" | tail -12
fi
if [[ $what == moe_prefill ]]; then
  # Prefill tiles: exactness + Flash/Pro timings per algorithm, then the ablations at 4096.
  for alg in ${PREFILL_ALGORITHMS:-wgmma_fp8 wgmma}; do
    timeout ${CHECK_TIMEOUT:-150} python3 benchmarks/moe_kernel_check.py --prefill \
      --prefill-algorithm "$alg" 2>&1 | grep -v Warning | tee "$OUT/moe_prefill_$alg.log"
  done
  (cd benchmarks && timeout ${ABLATION_TIMEOUT:-150} python3 moe_kernel_ablation.py \
    ${ABLATION_TOKENS:-4096} 2>&1 \
    | grep -v Warning | tee "$OUT/moe_ablation_prefill.log")
fi
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
ncu_report() {  # $1: report name under $OUT; details, source-level stall table
  "$ncu" --import "$OUT/$1.ncu-rep" --page details >"$OUT/ncu_details_$1.txt" 2>&1
  "$ncu" --import "$OUT/$1.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/ncu_sass_$1.csv" 2>&1
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy" \
    "$OUT/ncu_details_$1.txt" | head -30
  python3 benchmarks/ncu_top_stalls.py "$OUT/ncu_sass_$1.csv" 45
}
# The MoE op's GPU tests on one -k expression, into $OUT/moe_gpu_tests_NAME.log. XLA's GEMM
# autotuning off: each case compiles new XLA programs (the op and the chunked reference at
# its own shapes), and autotuning made that most of a Flash/Pro case's time. -v: a case
# that passed is on record even when the time limit cuts the run short.
moe_pytest() {  # name, -k expression
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout ${TEST_TIMEOUT:-540} \
    python3 -m pytest -m gpu -v -p no:cacheprovider -n 0 --durations=8 -k "$2" \
    tests/test_moe.py tests/test_moe_glue.py tests/test_model_gpu.py \
    >"$OUT/moe_gpu_tests_$1.log" 2>&1
}
if [[ $what == moe_tests ]]; then
  part=${1:-general}
  select=$([[ $part == decode ]] && echo "decode_kernels" || echo "not decode_kernels")
  [[ -n ${2:-} ]] && select="$select and ($2)"   # e.g. "flash and not wgmma"
  moe_pytest "$part" "$select"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/moe_gpu_tests_$part.log" | tail -40
fi
if [[ $what == moe_bench ]]; then
  # The op benchmark in full: Flash and Pro, T = 1 ... 16384, balanced and skewed routings.
  timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_moe.py --out "$OUT/bench_moe_full.md" \
    "$@" 2>&1 | grep -v Warning | tee "$OUT/bench_moe_full.log" | tail -40
fi
if [[ $what == model ]]; then
  # Model level at real Flash dims (decode_step.py): prefill chunks with the 4096-token
  # breakdown (kernels only past 2048 tokens: XLA's MoE runs out of memory there), then
  # decode per layer, kernels vs the MoE on XLA, with the batch-8 breakdown; each bounded.
  timeout ${PREFILL_TIMEOUT:-300} python3 benchmarks/decode_step.py --prefill \
    --chunks ${CHUNKS:-512,2048,4096,8192} --impls auto,moe=xla --out "$OUT/model_prefill.md" \
    2>&1 | grep -v Warning | tee "$OUT/model_prefill.log" | grep -E "^prefill|^\|" | tail -40
  timeout ${DECODE_TIMEOUT:-260} python3 benchmarks/decode_step.py --decode \
    --batches ${BATCHES:-1,8,64} --impls auto,moe=xla --out "$OUT/model_decode.md" 2>&1 \
    | grep -v Warning | tee "$OUT/model_decode.log" | grep -E "^decode|^\|" | tail -40
fi
if [[ $what == moe_tests_all ]]; then
  # Every MoE GPU case in one call: seven pytest processes share the GPU (compilation, on the
  # CPU, is most of a case). The platform allocator gives freed memory back at once, so the
  # processes need the sum of what they hold at a time, not of their peaks; Pro (the largest
  # weights and reference) alone in one process.
  run_part() { XLA_PYTHON_CLIENT_ALLOCATOR=platform moe_pytest "$@"; }
  run_part pro "pro" &
  run_part flash_fp4 "flash and fp4" &
  run_part flash_rest "flash and not fp4" &
  run_part small_general_fp4 "not decode_kernels and not flash and not pro and fp4" &
  run_part small_general_rest "not decode_kernels and not flash and not pro and not fp4" &
  run_part small_decode_fp4 "decode_kernels and small and fp4" &
  run_part small_decode_rest "decode_kernels and small and not fp4" &
  wait
  for f in "$OUT"/moe_gpu_tests_*.log; do
    echo "== $f"; grep -E "FAILED|ERROR|Timeout|[0-9]+ (passed|failed)" "$f" | tail -8
    echo "PASSED $(grep -c ' PASSED' "$f"), FAILED $(grep -c ' FAILED' "$f"), last: $(grep -E \
      ' PASSED| FAILED' "$f" | tail -1)"
  done
fi
if [[ $what == moe_detail ]]; then
  tokens=${1:-8}; alg=${2:-mma_sync}
  (cd benchmarks && timeout ${ABLATION_TIMEOUT:-150} python3 moe_kernel_ablation.py "$tokens" ${ABLATION_ARGS:---warp-only} 2>&1 \
    | grep -v Warning | tee "$OUT/moe_ablation.log")
  (cd benchmarks && timeout ${TRACE_TIMEOUT:-120} python3 profile_moe.py 1,8,64 --algorithm "$alg" 2>&1 \
    | grep -v Warning | tee "$OUT/moe_trace.log")
  # Only the sections needed, application replay: --set full with kernel replay crashed
  # the process (2026-11-23), and the launch reads GBs of weights that replay would save.
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${PROFILE_TIMEOUT:-150} "$ncu" \
    --clock-control none --replay-mode application --app-replay-match grid \
    --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section SourceCounters --section LaunchStats \
    -k regex:GroupedGemm --launch-skip 2 --launch-count 1 -f -o "$OUT/moe_$tokens" \
    python3 benchmarks/profile_moe.py "$tokens" --algorithm "$alg" --launch-only \
    >"$OUT/ncu_run_moe.log" 2>&1 || tail -20 "$OUT/ncu_run_moe.log"
  ncu_report "moe_$tokens"
fi
if [[ $what == gemm_ncu ]]; then
  # Further arguments go to decode_gemms.py (e.g. --row-blocks --ncu-index 1: that variant);
  # NCU_TAG names the report apart.
  gemm=${1:-wq_b}; tokens=${2:-1}; shift 2 || true
  report="gemm_${gemm}_$tokens${NCU_TAG:-}"
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${PROFILE_TIMEOUT:-200} "$ncu" \
    --clock-control none --replay-mode kernel \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters \
    --section LaunchStats -k regex:GroupedGemm --launch-skip 4 --launch-count 1 \
    -f -o "$OUT/$report" python3 benchmarks/decode_gemms.py --gemms "$gemm" \
    --tokens "$tokens" --ncu "$@" >"$OUT/ncu_run_gemm.log" 2>&1 || tail -20 "$OUT/ncu_run_gemm.log"
  ncu_report "$report"
fi
if [[ $what == op_ncu ]]; then
  # Nsight Compute of the fifth launch of a kernel whose name matches $1 in the command
  # that follows, e.g. op_ncu HcPreSm90 python3 benchmarks/bench_hc_pre.py --dims flash
  # --tokens 1 --impls cute --runs 8
  regex=${1:-HcPreSm90}; shift
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${PROFILE_TIMEOUT:-200} "$ncu" \
    --clock-control none --replay-mode kernel \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters \
    --section LaunchStats -k "regex:$regex" --launch-skip 4 --launch-count 1 \
    -f -o "$OUT/op_$regex" "$@" >"$OUT/ncu_run_op.log" 2>&1 || tail -20 "$OUT/ncu_run_op.log"
  ncu_report "op_$regex"
fi
if [[ $what == prefill_ncu ]]; then
  alg=${1:-wgmma_fp8_coop}; tokens=${2:-4096}
  kernel=$(python3 -c "from dsv4_jax.kernels.grouped_gemm_config import KERNELS; \
print(KERNELS['$alg'].class_name)") || exit 1
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${PROFILE_TIMEOUT:-200} "$ncu" \
    --clock-control none --replay-mode kernel \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters \
    --section LaunchStats -k "regex:${kernel}_" --launch-count 1 \
    -f -o "$OUT/prefill_${alg}_$tokens" python3 benchmarks/moe_kernel_ablation.py "$tokens" \
    --only "$alg" >"$OUT/ncu_run_prefill.log" 2>&1 || tail -20 "$OUT/ncu_run_prefill.log"
  ncu_report "prefill_${alg}_$tokens"
fi
if [[ $what == profile ]]; then
  tag=${1}_${2}
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${PROFILE_TIMEOUT:-240} "$ncu" \
    --clock-control none --set full -k regex:SparseAttentionSm90_object --launch-skip 2 \
    --launch-count 1 -f -o "$OUT/sa_$tag" python3 benchmarks/profile_sparse_attention.py "$@" \
    >"$OUT/ncu_run_$tag.log" 2>&1 || tail -20 "$OUT/ncu_run_$tag.log"
  ncu_report "sa_$tag"
fi
