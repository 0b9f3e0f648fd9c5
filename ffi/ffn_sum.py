"""A MoE sub-block's output left as its parts, for the op that consumes it to add them.

The MoE output of token t is ``cast(((r_0 + r_1) + ... + r_{k-1}) + shared[t])``: its k routed
rows and the shared expert's row, added in f32 in that order, cast to the shared row's dtype
(``models/moe.py``; ``moe_reference.sum_rows_per_token``). ``FfnSum`` holds those parts
unsummed, so that the next sub-block's mHC pre (``ffi.hc_pre``, whose first step is that
output's hc_post) adds them in its own launch -- the sum is then not an XLA launch of its own
between the experts and the mHC pre on a decode step's critical path (docs/performance.md,
"the step's critical path, measured"). ``total()`` is the sum as the model writes it, and
the kernel adds in the same order: both give the same bits.

    rows:     [A, d]   the routed rows, A = T k, in any order (a kernel's sorted rows)
    position: [A]      int32: assignment a = t k + j (token t's j-th expert) is row position[a]
    valid:    [A]      bool, by row: a row whose expert id was dropped counts as 0
    shared:   [..., d] the shared expert's output; T = the product of its leading dims
    k:        static   experts per token
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .moe_reference import sum_rows_per_token

__all__ = ["FfnSum", "check_ffn_sum"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FfnSum:
    """See the module docstring."""
    rows: jax.Array
    position: jax.Array
    valid: jax.Array
    shared: jax.Array
    k: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.shared.shape)

    @property
    def dtype(self):
        return self.shared.dtype

    def total(self) -> jax.Array:
        """The MoE output ``[..., d]`` in the shared row's dtype: the routed rows of each
        token added in f32 in expert order (dropped rows as +0), then the shared row."""
        d = self.shared.shape[-1]
        t = math.prod(self.shared.shape[:-1])
        rows = jnp.where(self.valid[:, None], self.rows, jnp.zeros((), self.rows.dtype))
        y = sum_rows_per_token(rows, None, t, self.k, position=self.position)
        y = y + self.shared.reshape(t, d).astype(jnp.float32)
        return y.astype(self.shared.dtype).reshape(self.shared.shape)


def check_ffn_sum(value: FfnSum, op: str) -> None:
    """``ValueError``/``TypeError`` naming the part and the shapes, in one line."""
    d = value.shared.shape[-1]
    t = math.prod(value.shared.shape[:-1])
    a = t * value.k
    for name, arr, want in (("rows", value.rows, (a, d)), ("position", value.position, (a,)),
                            ("valid", value.valid, (a,))):
        if tuple(arr.shape) != want:
            raise ValueError(f"{op}: FfnSum {name} must be {list(want)} for shared of shape "
                             f"{tuple(value.shared.shape)} and k = {value.k}; it has shape "
                             f"{tuple(arr.shape)}")
    if value.position.dtype != jnp.int32 or value.valid.dtype != jnp.bool_:
        raise TypeError(f"{op}: FfnSum position must be int32 and valid bool; they are "
                        f"{value.position.dtype} and {value.valid.dtype}")
