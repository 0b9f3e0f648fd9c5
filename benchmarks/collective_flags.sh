#!/bin/bash
# The expert-parallel decode loop under XLA flag sets that change how collectives run: the same
# flash_multi_gpu.py --batches run once per flag set, each in a fresh process (XLA reads its
# flags when the backend starts), after a probe that drops flags this jaxlib does not know.
#   source .device/setup.sh && source benchmarks/kernel_cache.sh && kernel_cache_restore
#   LAYERS=8 BATCHES=1,8 bash benchmarks/collective_flags.sh
# Logs: $OUT/flags_<name>.log; a summary line per flag set on stdout. DUMP=1 also dumps the
# first set's optimised HLO of the loop and lists its copies ($OUT/loop_copies.txt).
set -u
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.93}
MODEL=${MODEL:-flash}; LAYERS=${LAYERS:-8}; BATCHES=${BATCHES:-1,8}; STEPS=${STEPS:-24}
# The model's own command-buffer set (dsv4_jax/_xla_flags.py) and the same plus collectives.
BASE="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
declare -A SETS=(
  [a_model]=""
  [b_collectives_in_graphs]="--xla_gpu_enable_command_buffer=$BASE,COLLECTIVES"
  [c_symmetric]="--xla_gpu_enable_command_buffer=$BASE,COLLECTIVES --xla_gpu_experimental_enable_nccl_symmetric_buffers=true"
  [d_collective_kernels]="--xla_gpu_enable_command_buffer=$BASE,COLLECTIVES --xla_gpu_experimental_use_collective_kernels=ALL_GATHER,ALL_REDUCE"
  [e_nvshmem]="--xla_gpu_enable_command_buffer=$BASE,COLLECTIVES --xla_gpu_experimental_enable_nvshmem=true"
)
ORDER=${ORDER:-a_model b_collectives_in_graphs c_symmetric d_collective_kernels e_nvshmem}

probe() {       # whether this jaxlib accepts every flag of $1
  XLA_FLAGS="$1" timeout 60 python3 -c "import jax; jax.numpy.ones(2).block_until_ready()" \
    >/dev/null 2>"$OUT/probe.err"
}

first=1
for name in $ORDER; do
  flags=${SETS[$name]}
  if [[ -n "$flags" ]] && ! probe "$flags"; then
    echo "$name: flags refused: $(grep -m1 -o 'Unknown flag[^$]*' "$OUT/probe.err" | cut -c1-200)"
    continue
  fi
  extra=""
  if [[ $first == 1 && ${DUMP:-0} == 1 ]]; then
    extra="--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_as_text"
  fi
  first=0
  XLA_FLAGS="$flags $extra ${EXTRA_XLA_FLAGS:-}" timeout ${RUN_TIMEOUT:-240} python3 benchmarks/flash_multi_gpu.py --model "$MODEL" \
    --layers "$LAYERS" --batches "$BATCHES" --ctx 4096 --steps "$STEPS" \
    > "$OUT/flags_$name.log" 2>&1
  echo "$name (rc $?): $(grep -o '"generate_step_ms": [0-9.]*' "$OUT/flags_$name.log" | tr '\n' ' ')"
  grep -m3 -iE "error|Traceback" "$OUT/flags_$name.log" | cut -c1-300
done

if [[ ${DUMP:-0} == 1 && -d /tmp/xla_dump ]]; then
  # The loop's optimised module is the largest after-optimizations text file.
  f=$(ls -S /tmp/xla_dump/*after_optimizations.txt 2>/dev/null | head -1)
  { echo "module: $f"; echo "copies by shape:"
    grep -E " copy\(" "$f" | sed -E 's/^ *(ROOT )?([^ ]+) = ([^ ]+) copy.*/\3/' | sort | uniq -c | sort -rn | head -30
    echo "copies:"; grep -E " copy\(" "$f" | cut -c1-400 | head -200; } > "$OUT/loop_copies.txt"
  gzip -c "$f" > "$OUT/loop_after_optimizations.txt.gz"
fi
