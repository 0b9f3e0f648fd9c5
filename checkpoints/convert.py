"""``python -m dsv4_jax convert SRC DST``: an official HF directory -> our orbax layout.

Streams layer by layer on the host CPU (no accelerator needed): each group of tensors
(``layers_<i>``, ``embed``, ...) is read, converted and saved before the next one is read,
so host memory stays around one layer even for DeepSeek-V4-Pro. Loading the result with
``dsv4_jax.load(DST)`` then skips the safetensors parsing and name mapping.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
from jax.sharding import SingleDeviceSharding

from . import hf, orbax_io


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="official HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("dst", help="output directory for the orbax checkpoint")
    parser.add_argument("--dequantize", action="store_true",
                        help="store plain weights instead of FP8/FP4 + E8M0 scales")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="model dtype stored in the config (float32 upcasts BF16 leaves)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing dsv4_jax checkpoint at DST")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: when stderr is a terminal)")


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    try:
        cfg, groups = hf.prepare(args.src, dequantize=args.dequantize, shardings=cpu,
                                 dtype=args.dtype, progress=args.progress)
        out = orbax_io.write_groups(args.dst, cfg, groups, overwrite=args.overwrite,
                                    progress=False)
    except (FileNotFoundError, FileExistsError, ValueError, TypeError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    kind = "plain" if not cfg.quantized else f"FP8 + {cfg.expert_dtype.upper()} experts"
    print(f"wrote {out} ({kind}, dtype {cfg.dtype}) in {time.perf_counter() - start:.1f} s")
    return 0
