"""JAX's persistent compilation cache, on by default for the CLI and ``generate``.

Compiling the model's programs is most of a short run (9 of 12 s for the main command on two
CPU cores), and it is the same work every time. With the cache a second identical run loads
the executables from disk and compiles nothing.

Where: ``--compilation-cache`` (CLI) > ``DSV4_COMPILATION_CACHE`` > the user cache folder
(``$XDG_CACHE_HOME/dsv4_jax/jax``, default ``~/.cache/dsv4_jax/jax``). The value ``off`` (or
``0``, ``false``, ``none``, empty) disables it. A folder the user configured in JAX itself
(``jax_compilation_cache_dir``) is left alone.

The cache is trusted input: whoever can write to the folder can make this process run code
(JAX's own warning), so it lives in the user's private cache folder by default.
"""
from __future__ import annotations

import os

ENV = "DSV4_COMPILATION_CACHE"
OFF = ("off", "0", "false", "none", "")

_enabled_dir: str | None = None


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv4_jax", "jax")


def resolve(setting: str | None = None) -> str | None:
    """The cache folder ``setting`` (a flag value), the environment or the default name, or
    None when disabled."""
    if setting is None:
        setting = os.environ.get(ENV)
    if setting is None:
        return default_dir()
    if setting.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(setting))


def enable_compilation_cache(setting: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at ``resolve(setting)`` and cache every
    program, however small or fast to compile (ours are, on the tiny model). Returns the
    folder in use, or None. Idempotent; a folder set in JAX by the user wins."""
    global _enabled_dir
    import jax
    path = resolve(setting)
    current = jax.config.jax_compilation_cache_dir
    if current and current != _enabled_dir:        # the user's own setting
        return current
    if path is None or path == _enabled_dir:
        return _enabled_dir if path else None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{ENV}/--compilation-cache: cannot create {path!r}: {e}") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if _enabled_dir is not None:                   # JAX opened the previous folder already
        _reset_jax_cache()
    _enabled_dir = path
    return path


def _reset_jax_cache() -> None:
    try:
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except (ImportError, AttributeError):          # private API moved: the new folder may
        pass                                       # then take effect only in a new process
