"""JAX-facing ops: each has a pure-JAX reference and, where it pays, a CuTe DSL kernel."""
from .moe import (moe_expert_rows, moe_expert_rows_reference, moe_experts,
                  moe_experts_reference)
from .sparse_attention import sparse_attention, sparse_attention_reference

__all__ = ["moe_expert_rows", "moe_expert_rows_reference", "moe_experts",
           "moe_experts_reference", "sparse_attention", "sparse_attention_reference"]
