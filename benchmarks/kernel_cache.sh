#!/bin/bash
# Carry compiled CuTe kernels from one device call to the next: each call usually gets a fresh
# machine, which otherwise recompiles every kernel it runs (ffi/cute_call.py's disk cache is
# keyed by kernel source, argument spec, versions and CUTE_DSL_* settings, so a stale entry is
# never used).
#
# Here, after a call that saved one: mkdir -p .kcache && cp <files_at>/kernels.tar .kcache/
# (.kcache/ is git-ignored), then carry [".device", ".kcache"]. On the device:
#   source .device/setup.sh && source benchmarks/kernel_cache.sh && kernel_cache_restore
#   ... tests, benchmarks ...
#   kernel_cache_save            # $OUT/kernels.tar, the newest entries up to KERNEL_CACHE_MB
# The bundle in .device takes ~54 MiB of the 64 MiB a call carries: keep the tar under ~7 MiB.
export DSV4_KERNEL_CACHE=${DSV4_KERNEL_CACHE:-/tmp/dsv4_kernels}

kernel_cache_restore() {
  mkdir -p "$DSV4_KERNEL_CACHE"
  if [[ -f .kcache/kernels.tar ]]; then
    tar -xf .kcache/kernels.tar -C "$DSV4_KERNEL_CACHE" || echo "kernel cache: unreadable tar"
  fi
  echo "kernel cache: $(ls "$DSV4_KERNEL_CACHE" | wc -l) entries in $DSV4_KERNEL_CACHE"
}

kernel_cache_save() {
  local out=${OUT:-./device_out} cap=$(( ${KERNEL_CACHE_MB:-7} << 20 ))
  mkdir -p "$out"
  (cd "$DSV4_KERNEL_CACHE" && ls -t | python3 -c '
import os, sys
cap, total = int(sys.argv[1]), 0
for name in sys.stdin.read().split():
    size = os.path.getsize(name)
    if total + size <= cap:
        total += size
        print(name)' "$cap" > /tmp/kernel_cache_list && tar -cf "$out/kernels.tar" -T /tmp/kernel_cache_list)
  echo "kernel cache: saved $(wc -l < /tmp/kernel_cache_list) entries to $out/kernels.tar"
}
