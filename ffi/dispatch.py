"""Choosing between an op's CuTe kernel and its pure-JAX reference.

Every op takes ``implementation``: ``"cute"`` (the kernel; raises when it cannot run),
``"xla"`` (the reference) or ``None`` (the kernel when this process targets CUDA, ``cutlass``
loads and the kernel supports the shapes, else the reference). ``None`` lowers through
``jax.lax.platform_dependent``, so one jitted function runs on CPU and GPU.

``DSV4_IMPLEMENTATION`` overrides the choice for A/B debugging: ``xla`` forces the reference
everywhere, even over an explicit ``"cute"``; ``cute`` turns ``None`` into ``"cute"``. A
comma list ``op=impl`` (``sparse_attention=xla,...``) scopes it to single ops. The variable
is read when a function is traced: already-jitted functions keep their choice.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import Literal

import jax

from ._arch import pin_arch

ENV_VAR = "DSV4_IMPLEMENTATION"
IMPLEMENTATIONS = ("cute", "xla")
Choice = Literal["cute", "xla", "auto"]

_assume_cuda = contextvars.ContextVar("dsv4_assume_cuda", default=False)


@contextlib.contextmanager
def cuda_target():
    """Trace as if CUDA were the target although this process has no GPU.

    For CPU CI and ahead-of-time export: ``jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`` inside this context emits the kernels' custom calls.
    """
    token = _assume_cuda.set(True)
    try:
        yield
    finally:
        _assume_cuda.reset(token)


@functools.lru_cache(maxsize=None)
def _process_has_cuda() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def targets_cuda() -> bool:
    """Whether traced code may lower for CUDA: a local GPU, or inside ``cuda_target()``."""
    return _assume_cuda.get() or _process_has_cuda()


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


def env_override(op_name: str) -> str | None:
    """The ``DSV4_IMPLEMENTATION`` value that applies to ``op_name``, if any."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw or raw in ("auto", "none"):
        return None
    value = None
    for item in raw.split(","):
        item = item.strip()
        name, sep, impl = item.partition("=")
        if not sep:
            value = item if value is None else value
        elif name.strip() == op_name:
            value = impl.strip()
    if value is not None and value not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV_VAR}={raw!r}: the value for {op_name} must be one of "
                         f"{IMPLEMENTATIONS} (or op=impl pairs)")
    return value


def select_implementation(op_name: str, implementation: str | None,
                          supported: tuple[bool, str]) -> Choice:
    """Resolve ``implementation`` for one call: ``"cute"``, ``"xla"`` or ``"auto"``.

    ``supported`` is the kernel's ``(ok, reason)`` for these arguments. ``"auto"`` means: emit
    the kernel for CUDA and the reference for other platforms.
    """
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"{op_name}: implementation must be 'cute', 'xla' or None, "
                         f"got {implementation!r}")
    forced = env_override(op_name)
    if forced == "xla":
        return "xla"
    if implementation is None and forced == "cute":
        implementation = "cute"
    if implementation == "xla":
        return "xla"
    ok, reason = supported
    if implementation == "cute":
        available, why = cutlass_available()
        if not available:
            raise RuntimeError(f"{op_name}(implementation='cute'): {why}")
        if not ok:
            raise ValueError(f"{op_name}(implementation='cute') does not support {reason}; "
                             f"use implementation=None or 'xla'")
        if not targets_cuda():
            raise RuntimeError(
                f"{op_name}(implementation='cute') needs a CUDA GPU and this process has "
                f"none; use implementation=None (falls back to the reference), or trace "
                f"inside dsv4_jax.ffi.dispatch.cuda_target() to lower for CUDA ahead of time")
        return "cute"
    if ok and targets_cuda() and cutlass_available()[0]:
        return "auto"
    return "xla"


def cute_or_reference(cute_fn, reference_fn, *args):
    """Run ``cute_fn`` when lowering for CUDA and ``reference_fn`` elsewhere."""
    return jax.lax.platform_dependent(*args, cuda=cute_fn, default=reference_fn)
