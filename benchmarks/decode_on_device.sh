#!/bin/bash
# The decode step on the device machine. Logs and tables go to $OUT (or ./device_out). Modes run
# in the order given:
#   source .device/setup.sh && bash benchmarks/decode_on_device.sh generate [graphs] [tests]
#   (IMPLS: the kernel policies compared, decode_step.py --impls; default auto)
#   generate: dj.generate's loop per layer at BATCHES (1,8,64) x CTXS (4096), kernels attributed
#             to the model's modules at ATTRIBUTE (1,8); no command buffers
#             (--xla_gpu_enable_command_buffer=, the loop driven by the host): the profiler
#             then sees every kernel under its own HLO op (inside command buffers it names
#             only the buffer), so device time, launches per step and critical_path.py's op
#             times are real (its wall time is the host-driven loop's: the users' is the
#             graphs mode's).
#             PROFILE_GRAPHS=1: the users' CUDA graphs kept while profiling
#             (--xla_enable_command_buffers_during_profiling); measured on an H200, the
#             trace then holds only the launches outside the graphs (37 of ~250 per step),
#             not the graphs' kernels: wall time is all it gives (docs/performance.md)
#   graphs:   wall time per step as users run it (dsv4_jax's flags: the while loop in CUDA
#             graphs), at BATCHES x CTXS, no profile
#   ab:       graphs with the change of the patch AB_PATCH (applied in the checkout) and
#             without it (the patch reversed, `patch -R`), alternating ROUNDS (2) times in one
#             call: a before/after on one machine (the kernel cache keys on kernel sources)
#   tests:    GPU tests of the grouped-GEMM op at the model's shapes and of the model
#   prefill:  decode_step.py --prefill at CHUNKS (4096)
#   prefill_ab: the prefill chunk (no profile) with the change of AB_PATCH and without it,
#             alternating ROUNDS (2) times in one call, as ab does for the decode step
#   moe_tests: the routed experts' GPU tests (tests/test_moe.py), two processes
#   checks:   GPU tests of the FP8 cache, the model and the indexer kernels, three processes
#             (a test hanging past HANG_S (300) s dumps its stack into the log)
#   long:     long_context.py: a CHUNK (4096) chunk at PREFIXES (0,32768,131072), a PROMPT-token
#             dj.generate (0: skipped), decode at DECODE_CTXS (none) x BATCHES
# Compiled kernels come from .kcache/kernels.tar when carried and go back in $OUT/kernels.tar
# (benchmarks/kernel_cache.sh).
set -u
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DSV4_KERNEL_CACHE=/tmp/dsv4_kernels
# Kernels compiled by an earlier call (.kcache/kernels.tar, carried): benchmarks/kernel_cache.sh
source benchmarks/kernel_cache.sh && kernel_cache_restore
python3 -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
python3 -c "import jax, dsv4_jax.ffi, cutlass; print('jax', jax.__version__, jax.devices())" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
steps=${STEPS:-24}
run_bench() {  # name, extra XLA flags, timeout, decode_step args...
  local name=$1 flags=$2 limit=$3; shift 3
  (cd benchmarks && XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout "$limit" python3 \
    decode_step.py --out "$OUT/$name.md" "$@" 2>&1 \
    | grep -v Warning | tee "$OUT/$name.log" | grep -E "^generate|^prefill|^\||^\*\*|rror" \
    | tail -${TAIL:-40})
}
for what in "$@"; do
  case $what in
    generate) gen=(--generate --impls ${IMPLS:-auto} --batches ${BATCHES:-1,8,64} --ctxs ${CTXS:-4096}
                   --steps $steps --attribute-batches ${ATTRIBUTE:-1,8} --top ${TOP:-12})
              if [[ ${PROFILE_GRAPHS:-0} == 1 ]]; then
                run_bench generate --xla_enable_command_buffers_during_profiling=true \
                  ${GEN_TIMEOUT:-330} "${gen[@]}"
              else
                run_bench generate --xla_gpu_enable_command_buffer= ${GEN_TIMEOUT:-330} \
                  "${gen[@]}"
              fi ;;
    graphs) run_bench graphs "" ${GEN_TIMEOUT:-200} --generate --impls ${IMPLS:-auto} \
              --batches ${BATCHES:-1,8,64} --ctxs ${CTXS:-4096} --steps $steps --no-profile \
              --attribute-batches 0 ${SPECULATIVE:+--speculative} ;;
    ab) [[ -f ${AB_PATCH:-} ]] || { echo "ab: AB_PATCH must name a patch file"; exit 2; }
        for round in $(seq ${ROUNDS:-2}); do
          for side in with without; do
            echo "== $side the change ($AB_PATCH), round $round"
            [[ $side == without ]] && { patch -s -p1 -R < "$AB_PATCH" || exit 1; }
            TAIL=${TAIL:-3} run_bench "ab_${side}_$round" "" ${GEN_TIMEOUT:-200} --generate \
              --impls ${IMPLS:-auto} --batches ${BATCHES:-1,8,64} --ctxs ${CTXS:-4096} \
              --steps $steps --no-profile --attribute-batches 0
            [[ $side == without ]] && { patch -s -p1 < "$AB_PATCH" || exit 1; }
          done
        done ;;
    prefill) run_bench prefill "" ${PREFILL_TIMEOUT:-240} --prefill --impls auto \
               --chunks ${CHUNKS:-4096} --profile-chunk ${CHUNKS:-4096} ;;
    prefill_ab) [[ -f ${AB_PATCH:-} ]] || { echo "prefill_ab: AB_PATCH names no patch"; exit 2; }
        for round in $(seq ${ROUNDS:-2}); do
          for side in with without; do
            echo "== $side the change ($AB_PATCH), round $round"
            [[ $side == without ]] && { patch -s -p1 -R < "$AB_PATCH" || exit 1; }
            TAIL=${TAIL:-3} run_bench "prefill_ab_${side}_$round" "" ${PREFILL_TIMEOUT:-240} \
              --prefill --impls auto --chunks ${CHUNKS:-4096} --no-profile
            [[ $side == without ]] && { patch -s -p1 < "$AB_PATCH" || exit 1; }
          done
        done ;;
    long) (cd benchmarks && timeout ${LONG_TIMEOUT:-540} python3 long_context.py \
             --out "$OUT/long_context.md" --chunk ${CHUNK:-4096} \
             --prefixes ${PREFIXES:-0,32768,131072} --prompt ${PROMPT:-0} \
             ${DECODE_CTXS:+--decode-ctxs $DECODE_CTXS} --batches ${BATCHES:-1,8} --steps $steps \
             ${KV_DTYPE:+--kv-dtype $KV_DTYPE} 2>&1 \
             | grep -v Warning | tee "$OUT/long_context.log" | tail -${TAIL:-40}) ;;
    tests)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout ${TEST_TIMEOUT:-300} \
        python3 -m pytest -m gpu -v -p no:cacheprovider -n 0 --durations=8 \
        ${TEST_K:+-k "$TEST_K"} tests/test_hc_sinkhorn.py tests/test_hc_pre.py tests/test_router.py tests/test_grouped_gemm.py \
        tests/test_model_gpu.py \
        >"$OUT/gpu_tests.log" 2>&1
      grep -E " passed| failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -30 ;;
    checks)   # the FP8 cache, the model and the indexer kernels' GPU tests, three processes
      for file in test_kv_fp8 test_model_gpu test_indexer_kernel; do
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
          timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 \
          -o faulthandler_timeout=${HANG_S:-300} tests/$file.py >"$OUT/$file.log" 2>&1 &
      done
      wait
      tail -n 3 "$OUT"/test_kv_fp8.log "$OUT"/test_model_gpu.log "$OUT"/test_indexer_kernel.log ;;
    moe_tests)   # the routed experts' GPU cases, two processes on the one GPU
      for part in "decode_kernels" "not decode_kernels"; do
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout ${TEST_TIMEOUT:-420} \
          python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 -k "$part" \
          tests/test_moe.py >"$OUT/moe_tests_${part// /_}.log" 2>&1 &
      done
      wait
      tail -n 3 "$OUT"/moe_tests_*.log ;;
    *) echo "unknown mode $what"; exit 2 ;;
  esac
done
kernel_cache_save
