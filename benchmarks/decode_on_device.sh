#!/bin/bash
# The decode step on the device machine (issue: decode at the weight-bandwidth floor). Logs and
# tables go to $OUT (or ./device_out).
#   source .device/setup.sh && bash benchmarks/decode_on_device.sh generate
#       (dj.generate's loop per layer, batch 1/8/64 at ctx 4096 (CTXS, BATCHES), then batch
#        1 and 8 with XLA command buffers also capturing while loops and conditionals)
#   source .device/setup.sh && bash benchmarks/decode_on_device.sh tests
#       (GPU tests of the grouped-GEMM op at the model's shapes and of the model on the GPU)
#   source .device/setup.sh && bash benchmarks/decode_on_device.sh flags "XLA flags" [args]
#       (one generate run under the given XLA_FLAGS)
set -u
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
what=${1:-generate}; shift || true
export PYTHONUNBUFFERED=1 DSV4_KERNEL_CACHE=/tmp/dsv4_kernels
python3 -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
python3 -c "import jax, dsv4_jax.ffi, cutlass; print('jax', jax.__version__, jax.devices())" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
WHILE_GRAPHS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
generate() {  # name, extra XLA flags, decode_step args...
  local name=$1 flags=$2; shift 2
  (cd benchmarks && XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout ${GEN_TIMEOUT:-330} python3 \
    decode_step.py --generate --impls auto --out "$OUT/generate_$name.md" "$@" 2>&1 \
    | grep -v Warning | tee "$OUT/generate_$name.log" | grep -E "^generate|^\||^\*\*|rror" \
    | tail -60)
}
if [[ $what == generate ]]; then
  generate default "" --batches ${BATCHES:-1,8,64} --ctxs ${CTXS:-4096} --steps ${STEPS:-24}
  generate while_graphs "$WHILE_GRAPHS" --batches 1,8 --ctxs 4096 --steps ${STEPS:-24} \
    --no-profile
fi
if [[ $what == flags ]]; then
  flags=$1; shift
  generate flags "$flags" "$@"
fi
if [[ $what == tests ]]; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout ${TEST_TIMEOUT:-400} \
    python3 -m pytest -m gpu -v -p no:cacheprovider -n 0 --durations=8 ${TEST_K:+-k "$TEST_K"} \
    tests/test_grouped_gemm.py tests/test_model_gpu.py >"$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests.log" | tail -60
fi
