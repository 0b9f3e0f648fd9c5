"""The op registry: every op the model calls, under the name of the function users call.

Each op module registers one ``OpSpec`` per public op when it is imported (``ffi/__init__``
imports them all): its reference, the implementations it has and its kernel support check.
``dispatch.dispatch`` resolves an op's ``implementation`` against the registry, and
``policy.KernelPolicy`` validates op names against it, so a misspelt name fails with the
list of valid ones instead of being ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

REFERENCE = "xla"        # every op's pure-JAX reference
KERNEL = "cute"          # every op's CuTe DSL kernel path


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op: ``name`` is its public function's name.

    ``reference``: the pure-JAX definition (``<op>_reference``). ``support``: ``(*args,
    **kwargs) -> (ok, reason)`` for the kernel path, taking the op's own arguments and its
    kernel policy (``policy=``); it imports no cutlass. ``implementations``: the names
    ``implementation=`` accepts besides None (``"xla"`` first).
    """
    name: str
    reference: Callable
    support: Callable[..., tuple[bool, str]]
    implementations: tuple[str, ...] = (REFERENCE, KERNEL)

    def __post_init__(self):
        if not self.implementations or self.implementations[0] != REFERENCE:
            raise ValueError(f"OpSpec {self.name!r}: implementations must start with "
                             f"{REFERENCE!r}, got {self.implementations}")


_OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` (once per name; re-importing a module re-registers the same op)."""
    previous = _OPS.get(spec.name)
    if previous is not None and previous.reference.__qualname__ != spec.reference.__qualname__:
        raise ValueError(f"op {spec.name!r} is registered twice with different references")
    _OPS[spec.name] = spec
    return spec


def op_names() -> tuple[str, ...]:
    """The registered ops, sorted."""
    return tuple(sorted(_OPS))


def op_spec(name: str) -> OpSpec:
    """The spec of op ``name``; ``ValueError`` listing the valid names when unknown."""
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; the ops are {', '.join(op_names())}") from None


def check_implementation(op: str, implementation) -> None:
    """``ValueError`` unless ``implementation`` is None or one of ``op``'s implementations."""
    valid = op_spec(op).implementations
    if implementation is not None and implementation not in valid:
        raise ValueError(f"{op}: implementation must be one of {valid} or None, got "
                         f"{implementation!r}")
