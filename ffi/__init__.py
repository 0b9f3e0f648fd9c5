"""JAX-facing ops: each has a pure-JAX reference and, where it pays, a CuTe DSL kernel.

Importing this package registers every op (``registry.op_names()``); ``KernelPolicy``
(``policy.py``) chooses their implementations and kernel configurations as a value.
"""
from .ffn_sum import FfnSum
from .grouped_gemm import (grouped_gemm, grouped_gemm_pair, grouped_gemm_pair_reference,
                           grouped_gemm_reference)
from .hc_mixes import hc_stream_mixes, hc_stream_mixes_reference
from .hc_pre import hc_pre, hc_pre_reference
from .hc_sinkhorn import hc_split_sinkhorn, hc_split_sinkhorn_reference
from .indexer import index_topk, index_topk_reference
from .moe import (moe_expert_rows, moe_expert_rows_reference, moe_experts,
                  moe_experts_reference)
from .policy import GroupedGemmPolicy, KernelPolicy
from .registry import op_names, op_spec
from .router import moe_router, moe_router_reference
from .sparse_attention import sparse_attention, sparse_attention_reference

__all__ = ["FfnSum", "grouped_gemm", "grouped_gemm_reference", "grouped_gemm_pair",
           "grouped_gemm_pair_reference", "hc_pre", "hc_pre_reference", "hc_stream_mixes",
           "hc_stream_mixes_reference",
           "hc_split_sinkhorn",
           "hc_split_sinkhorn_reference", "index_topk", "index_topk_reference",
           "moe_expert_rows", "moe_expert_rows_reference", "moe_experts", "moe_experts_reference",
           "moe_router", "moe_router_reference",
           "sparse_attention", "sparse_attention_reference", "GroupedGemmPolicy",
           "KernelPolicy", "op_names", "op_spec"]
