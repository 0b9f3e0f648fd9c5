"""XLA flags the model needs, set before JAX creates its backends.

1. Round where the model rounds: ``--xla_allow_excess_precision=false``.

DSV4's reference numerics round to BF16 after specific operations (norm outputs, mHC
collapse, GEMM outputs, ...). By default XLA may drop a ``convert(f32->bf16->f32)`` pair when
it fuses ops ("excess precision"), and whether it does depends on the fusion, hence on the
shapes: a prefill and the same tokens decoded one by one would then round differently and
disagree by ~0.5% in BF16. With the flag off every written rounding happens, and chunked
prefill, decode and full forward are bitwise reproducible.

2. Run whole decode loops from CUDA graphs: ``--xla_gpu_enable_command_buffer`` with XLA's
default command types plus ``WHILE`` and ``CONDITIONAL`` (opt-in in XLA), so that the
``lax.while_loop`` of ``generate`` -- and the ``platform_dependent`` branches inside -- are
recorded into command buffers instead of being driven from the host step by step
(docs/performance.md, "Decode step": faster per step at batch 1 and 8).

3. No weight copied on each call: ``--xla_gpu_dot_merger_threshold_mb=0``. XLA's DotMerger
turns dots that share an input into one dot over the concatenation of their weights; inside a
decode step that concatenation is an op of its own, run on every call: a CSA layer's five BF16
compressor and indexer projections became a copy of 21 MB of weights per layer and step
(docs/performance.md, "a weight copy XLA made per step"). With the pass off each projection
reads its own weight.

4. Let a command buffer's independent commands run at once:
``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``. XLA records a command buffer's
commands as a chain by default; in this mode the graph's edges follow the commands' buffer
conflicts. A decode step is dozens of small launches per layer whose branches (queries,
window entry, compressor, indexer) do not depend on each other, and each launch costs more
in latency than in work: in one graph they overlap (docs/performance.md, "Concurrent
commands"). Outputs are unchanged: the kernels, and so every sum's order, are the same.

The flags must be in ``XLA_FLAGS`` before JAX creates its backends; importing ``dsv4_jax``
first does that. A flag already in ``XLA_FLAGS`` is left as it is;
``DSV4_ALLOW_EXCESS_PRECISION=1`` leaves the first out, ``DSV4_COMMAND_BUFFERS=default`` the
second, ``DSV4_DOT_MERGER=xla`` the third, ``DSV4_COMMAND_SCHEDULING=xla`` the fourth.
"""
from __future__ import annotations

import os
import sys
import warnings

FLAG = "--xla_allow_excess_precision=false"
COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                   "DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL")
NO_DOT_MERGER = "--xla_gpu_dot_merger_threshold_mb=0"
CONCURRENT_COMMANDS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


def _backends_initialized() -> bool:
    if "jax" not in sys.modules:        # no JAX yet, so no backend (and none imported here)
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:       # private API moved: assume not initialised
        return False


def ensure_exact_rounding() -> bool:
    """Add the flag to ``XLA_FLAGS`` if possible; returns whether it is in effect."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" in flags:
        return FLAG in flags
    if os.environ.get("DSV4_ALLOW_EXCESS_PRECISION") == "1":
        return False
    if _backends_initialized():
        warnings.warn("dsv4_jax: JAX backends were created before dsv4_jax was imported, so "
                      f"XLA_FLAGS cannot get {FLAG}; BF16 results may then depend on how XLA "
                      "fuses (prefill vs decode differ by ~0.5%). Import dsv4_jax first or "
                      "set the flag yourself.", RuntimeWarning, stacklevel=3)
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + FLAG).strip()
    return True


def _ensure(flag: str, opted_out: bool) -> bool:
    """Add ``flag`` (``--name=value``) to ``XLA_FLAGS`` unless the user set that name, opted
    out, or the backends exist already; returns whether ``flag`` is in effect."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] + "=" in flags:
        return flag in flags
    if opted_out or _backends_initialized():
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()
    return True


def ensure_device_loops() -> bool:
    """Add ``COMMAND_BUFFERS`` to ``XLA_FLAGS`` if possible; returns whether it is in effect."""
    return _ensure(COMMAND_BUFFERS, os.environ.get("DSV4_COMMAND_BUFFERS") == "default")


def ensure_no_dot_merger() -> bool:
    """Add ``NO_DOT_MERGER`` to ``XLA_FLAGS`` if possible; returns whether it is in effect."""
    return _ensure(NO_DOT_MERGER, os.environ.get("DSV4_DOT_MERGER") == "xla")


def ensure_concurrent_commands() -> bool:
    """Add ``CONCURRENT_COMMANDS`` to ``XLA_FLAGS`` if possible; returns whether it is in
    effect."""
    return _ensure(CONCURRENT_COMMANDS, os.environ.get("DSV4_COMMAND_SCHEDULING") == "xla")


EXACT_ROUNDING = ensure_exact_rounding()
DEVICE_LOOPS = ensure_device_loops()
NO_WEIGHT_MERGING = ensure_no_dot_merger()
CONCURRENT_COMMAND_BUFFERS = ensure_concurrent_commands()
