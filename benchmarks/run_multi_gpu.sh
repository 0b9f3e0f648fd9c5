#!/bin/bash
# Multi-GPU session on the device machine: a tiny dry run, then DSV4-Flash (default) or -Pro at
# real size; every argument goes to flash_multi_gpu.py (--model flash|pro, --layers N, --data,
# --expert, --batch, --prompt, --steps, --max-len, --dry-run).
#   source .device/setup.sh && bash benchmarks/run_multi_gpu.sh [args]
#   RUN_NAME=pro RUN_TIMEOUT=570 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 \
#     bash benchmarks/run_multi_gpu.sh --model pro --batch 8 --prompt 1024 --max-len 4096
set -u
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DSV4_KERNEL_CACHE=/tmp/dsv4_kernels XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.93}
# editable install of the checkout, as in run_on_device.sh
python3 -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
env | grep -E "NCCL_NVLS_ENABLE|TORCH_SYMM|NVSHMEM_DISABLE" || true
mkdir -p $OUT/tiny; OUT=$OUT/tiny timeout ${TINY_TIMEOUT:-120} python3 benchmarks/flash_multi_gpu.py --model tiny \
  --batch 2 --prompt 16 --steps 4 --max-len 512 2>&1 | tee "$OUT/tiny.log" | cut -c1-300
timeout ${RUN_TIMEOUT:-${FLASH_TIMEOUT:-420}} python3 benchmarks/flash_multi_gpu.py "$@" 2>&1 \
  | tee "$OUT/${RUN_NAME:-flash}.log" | cut -c1-400
