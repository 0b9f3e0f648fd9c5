"""Count XLA compilations, persistent-cache hits, and the seconds spent tracing/lowering and
compiling (jax.monitoring)."""
from __future__ import annotations

import contextlib
import threading

import jax

_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration")
_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_active: list = []
_installed = False
# The cache-hit event fires inside the backend-compile span it belongs to, on the same thread.
_pending_hit = threading.local()


class CompileStats:
    """``compilations``: programs XLA compiled; ``cache_hits``: programs loaded from the
    persistent compilation cache instead; ``compile_s``: seconds compiling (cache loads
    excluded); ``trace_s``: seconds tracing and lowering to MLIR (spent on a hit too)."""

    def __init__(self):
        self.compilations = 0
        self.cache_hits = 0
        self.compile_s = 0.0
        self.trace_s = 0.0
        self.load_s = 0.0

    @property
    def seconds(self) -> float:
        """Every second the programs cost before running: tracing, compiling, cache loads."""
        return self.trace_s + self.compile_s + self.load_s


def _duration_listener(event, duration, **_):
    if event in _TRACE_EVENTS:
        field = "trace_s"
    elif event == _BACKEND_EVENT:
        hit = getattr(_pending_hit, "value", False)
        _pending_hit.value = False
        field = "load_s" if hit else "compile_s"
    else:
        return
    with _lock:
        for stats in _active:
            setattr(stats, field, getattr(stats, field) + duration)
            if field == "compile_s":
                stats.compilations += 1


def _event_listener(event, **_):
    if event != _CACHE_HIT_EVENT:
        return
    _pending_hit.value = True
    with _lock:
        for stats in _active:
            stats.cache_hits += 1


@contextlib.contextmanager
def count_compilations():
    """``with count_compilations() as c: ...`` then ``c.compilations``, ``c.compile_s``, ..."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_duration_listener)
            jax.monitoring.register_event_listener(_event_listener)
            _installed = True
        stats = CompileStats()
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)
