"""Choosing between an op's CuTe kernel and its pure-JAX reference: the one helper every op's
dispatch goes through.

Every op takes ``implementation``: ``"cute"`` (the kernel; raises when it cannot run),
``"xla"`` (the reference) or ``None`` (the kernel when this process targets a Hopper GPU,
``cutlass`` loads and the kernel supports the arguments, else the reference). ``None`` lowers
through ``jax.lax.platform_dependent``, so one jitted function runs on CPU and GPU. The choice
is a value passed in (``policy.KernelPolicy`` carries one per op for the model); nothing here
reads the environment.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import warnings
from typing import Callable, Literal

import jax

from ._arch import TARGET_ARCH, pin_arch
from .registry import KERNEL, REFERENCE, check_implementation

Choice = Literal["cute", "xla", "auto"]
# The kernels are compiled for sm_90a: compute capability 9.0 exactly (H100, H200).
KERNEL_COMPUTE_CAPABILITY = "9.0"

_assume_cuda = contextvars.ContextVar("dsv4_assume_cuda", default=False)


@contextlib.contextmanager
def cuda_target():
    """Trace as if a Hopper GPU were the target although this process has none.

    For CPU CI and ahead-of-time export: ``jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`` inside this context emits the kernels' custom calls.
    """
    token = _assume_cuda.set(True)
    try:
        yield
    finally:
        _assume_cuda.reset(token)


@functools.lru_cache(maxsize=None)
def _local_gpus() -> tuple[tuple[str, str], ...]:
    """``(device kind, compute capability)`` of this process's CUDA devices."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return ()
    return tuple((d.device_kind, str(getattr(d, "compute_capability", ""))) for d in devices)


@functools.lru_cache(maxsize=None)
def _process_has_kernel_gpu() -> bool:
    """Whether this process's GPUs run the sm_90a kernels; warns once when a CUDA GPU is
    there but is not a Hopper part (the ops then run their references)."""
    gpus = _local_gpus()
    other = [kind for kind, cc in gpus if cc != KERNEL_COMPUTE_CAPABILITY]
    if other:
        warnings.warn(f"dsv4_jax: the CuTe kernels need compute capability "
                      f"{KERNEL_COMPUTE_CAPABILITY} ({TARGET_ARCH}: H100/H200), this process "
                      f"has {', '.join(sorted(set(other)))}; every op runs its pure-JAX "
                      f"reference", RuntimeWarning, stacklevel=3)
        return False
    return bool(gpus)


def targets_cuda() -> bool:
    """Whether traced code may lower for the kernels' GPU: a local Hopper GPU, or inside
    ``cuda_target()``."""
    return _assume_cuda.get() or _process_has_kernel_gpu()


@functools.lru_cache(maxsize=None)
def cutlass_available() -> tuple[bool, str]:
    """Whether CuTe DSL and its JAX bridge import here (imported only when first asked)."""
    if importlib.util.find_spec("cutlass") is None:
        return False, "nvidia-cutlass-dsl is not installed"
    pin_arch()
    try:
        import cutlass.jax  # noqa: F401  (here, not at the top: loading CuTe DSL is optional)
    except Exception as e:  # a broken install must not break the reference path
        return False, f"cutlass.jax does not import ({type(e).__name__}: {e})"
    return True, ""


def select_implementation(op: str, implementation: str | None,
                          supported: Callable[[], tuple[bool, str]]) -> Choice:
    """Resolve ``implementation`` for one call of ``op``: ``"cute"``, ``"xla"`` or ``"auto"``
    (emit the kernel for CUDA and the reference for other platforms).

    ``supported()`` is the kernel's ``(ok, reason)`` for these arguments; it is only asked
    when the kernel could run."""
    check_implementation(op, implementation)
    if implementation == REFERENCE:
        return REFERENCE
    if implementation == KERNEL:
        available, why = cutlass_available()
        if not available:
            raise RuntimeError(f"{op}(implementation='cute'): {why}")
        ok, reason = supported()
        if not ok:
            raise ValueError(f"{op}(implementation='cute') does not support {reason}; "
                             f"use implementation=None or 'xla'")
        if not targets_cuda():
            raise RuntimeError(
                f"{op}(implementation='cute') needs a CUDA GPU of compute capability "
                f"{KERNEL_COMPUTE_CAPABILITY} and this process has none; use "
                f"implementation=None (falls back to the reference), or trace inside "
                f"dsv4_jax.ffi.dispatch.cuda_target() to lower for CUDA ahead of time")
        return KERNEL
    if targets_cuda() and cutlass_available()[0] and supported()[0]:
        return "auto"
    return REFERENCE


def dispatch(op: str, implementation: str | None, supported: Callable[[], tuple[bool, str]],
             reference: Callable, kernel: Callable, *operands):
    """Run ``reference(*operands)`` or ``kernel(*operands)`` as ``implementation`` and the
    kernel's support decide (``select_implementation``); with None both are lowered and
    ``jax.lax.platform_dependent`` keeps the kernel for CUDA. Operands are arrays (or None),
    positional: ``platform_dependent`` passes no keywords."""
    choice = select_implementation(op, implementation, supported)
    if choice == REFERENCE:
        return reference(*operands)
    if choice == KERNEL:
        return kernel(*operands)
    return jax.lax.platform_dependent(*operands, cuda=kernel, default=reference)
