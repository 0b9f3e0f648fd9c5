"""Kernel policy as a value: which implementation each op runs and how its kernels run.

``KernelPolicy`` is frozen and hashable; ``DSV4(cfg, implementation=policy)`` carries it to
every op call of the model, and each op takes its own part (``implementation=``,
``policy=``). Nothing below reads the environment while a function is traced: the
environment variables are parsed in one place, ``KernelPolicy.from_environment``, which the
entry points call (the command line, ``dsv4_jax.load``, the benchmarks).

Environment variables (all optional):

* ``DSV4_IMPLEMENTATION``: ``xla`` / ``cute`` for every op, or ``op=impl`` pairs
  (``sparse_attention=xla,moe_experts=cute``); op names are the registered ops' names
  (``dsv4_jax.ffi.registry.op_names()``).
* ``DSV4_MOE_ALGORITHM``, ``DSV4_MOE_PREFILL_ALGORITHM``, ``DSV4_MOE_SPLIT_K``: the grouped
  GEMM's decode algorithm, prefill algorithm and K split (``GroupedGemmPolicy``).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from dsv4_jax.kernels.grouped_gemm_config import (DECODE_ALGORITHMS, DEFAULT_DECODE_ALGORITHM,
                                                  DEFAULT_PREFILL_ALGORITHM,
                                                  FP8_TOKEN_BUFFERS, MAX_SPLIT_K,
                                                  MAX_TOKEN_STAGES, PREFILL_ALGORITHMS)
from dsv4_jax.kernels.sparse_attention_config import SparseAttentionSm90Config
from .registry import KERNEL, REFERENCE, check_implementation, op_spec

IMPLEMENTATION_ENV_VAR = "DSV4_IMPLEMENTATION"
ALGORITHM_ENV_VAR = "DSV4_MOE_ALGORITHM"
PREFILL_ALGORITHM_ENV_VAR = "DSV4_MOE_PREFILL_ALGORITHM"
SPLIT_K_ENV_VAR = "DSV4_MOE_SPLIT_K"
_OFF = ("", "auto", "none")
TOKEN_CODES = ("none", "gathered", "routed")         # GroupedGemmPolicy.token_codes


@dataclasses.dataclass(frozen=True)
class GroupedGemmPolicy:
    """How the grouped-GEMM kernels run (the routed experts and, through the same op, the
    dense linears). ``kernels.grouped_gemm_config.choose_config`` resolves it per launch
    into the kernel config that the support check and the launch both use.

    decode_algorithm: kernel for decode-size inputs (few rows per group): ``"auto"`` (the
      default: ``"wgmma_rs"``, K split for launches of more than
      ``grouped_gemm_config.AUTO_MAX_ROWS`` rows by ``many_rows_split_k``; but ``"mma_fp8"``
      for a gated launch of more rows that it does not split, and an ungated one of more
      than that many rows per group; measured per launch in docs/performance.md),
      ``"mma_fp8"``
      (FP8 tensor cores; where it does not apply -- BF16 weights, no FP8 activation
      simulation -- ``"mma_sync"`` runs), ``"mma_fp8_stream"`` (its MMAs with the weights
      loaded into registers; the same fallback), ``"wgmma_rs"`` (its conversion feeding
      warpgroup FP8 MMAs; the same fallback), ``"mma_sync"``, ``"wgmma"`` or
      ``"wgmma_fp8"``.
    prefill_algorithm: kernel for prefill-size inputs: ``"wgmma_fp8_coop"`` (the default: FP8
      WGMMAs, two math warpgroups that convert; without the FP8 activation simulation or with
      an odd number of 128-column K blocks ``"wgmma_coop"``), ``"wgmma_coop"`` (two math
      warpgroups, bf16 WGMMAs; FP4/FP8 weights and output features a multiple of 128, else
      ``"wgmma"``), ``"wgmma"`` or ``"wgmma_fp8"``.
    split_k: K split of the decode kernels for at most two tiles of rows: None (automatic:
      split a launch that would leave SMs idle, ``grouped_gemm_config.auto_split_k``, and
      "wgmma_rs" launches of more rows by ``many_rows_split_k``), or that many splits for
      at most two tiles of rows and none for more (1: none).
    pair_linears: linears that share their input (``ffi.grouped_gemm_pair``) in one launch
      of the decode kernels (False: a launch each, for comparisons).
    pdl: the decode kernels launch as programmatic dependents: each may begin while the
      kernel before it ends, and waits for it before reading what it wrote (dense linears
      load their first weight blocks before that wait; ``GroupedGemmSm90Config.pdl``). Off
      by default until it is shown to shorten the two-GPU step (docs/performance.md,
      "Programmatic dependent launch").
    token_codes: where the decode kernels that quantise their tokens ("mma_fp8",
      "wgmma_rs") take them quantised by XLA instead (``GroupedGemmSm90Config.token_codes``;
      the same codes, so the same outputs): ``"gathered"`` (the default: the routed
      experts' gated launch, whose sorted rows XLA gathers before it anyway -- the
      quantisation joins that gather, and the launch's CTAs no longer quantise the same rows
      each), ``"none"`` (each CTA quantises the rows it reads) or ``"routed"`` (both routed
      launches; w2's rows then cost a quantisation launch of their own). Measured in
      docs/performance.md ("token codes for the routed experts").
    row_norm_in_kernel: the decode kernels that quantise their tokens ("mma_fp8",
      "wgmma_rs") normalise the rows of an op's ``row_norm`` themselves (``wq_b`` after
      ``q_norm``: the norm then takes no launch); False (the default), XLA's ``rms_norm``
      runs before the launch, as for every other kernel. Off while it does not shorten the
      step (docs/performance.md, "q_norm inside wq_b").
    row_blocks: 64-row output blocks per CTA of the ungated decode launches of "mma_fp8" and
      "wgmma_rs" (``GroupedGemmSm90Config.row_blocks``): 1 (the default) or 2 wherever they
      apply. Two issue fewer instructions per weight byte, yet measured slower on the routed
      w2 and the dense linears (docs/performance.md, thirty-sixth session).
    token_stages: K blocks of token rows the decode launches of "mma_fp8" and "wgmma_rs"
      quantise (or copy) ahead, ``GroupedGemmSm90Config.token_stages``: None (the default)
      automatic -- ``grouped_gemm_config.FEW_TILES_TOKEN_STAGES`` for launches of at most
      two row tiles, ``UNSPLIT_TOKEN_STAGES`` for unsplit launches of more rows, 2 for split
      ones --, or that many (2 ... ``MAX_TOKEN_STAGES``) for every such launch.
    interleaved_split: the decode launches of FP4 weights that split K read interleaved K
      blocks per CTA (``GroupedGemmSm90Config.interleaved_split``): True (the default) or
      False (each CTA a contiguous range). Measured in docs/performance.md (thirty-seventh
      session).
    """
    decode_algorithm: str = DEFAULT_DECODE_ALGORITHM
    prefill_algorithm: str = DEFAULT_PREFILL_ALGORITHM
    split_k: int | None = None
    pair_linears: bool = True
    pdl: bool = False
    token_codes: str = "gathered"
    row_norm_in_kernel: bool = False
    row_blocks: int = 1
    token_stages: int | None = None
    interleaved_split: bool = True

    def __post_init__(self):
        for name, value, valid in (("decode_algorithm", self.decode_algorithm,
                                    DECODE_ALGORITHMS),
                                   ("prefill_algorithm", self.prefill_algorithm,
                                    PREFILL_ALGORITHMS)):
            if value not in valid:
                raise ValueError(f"GroupedGemmPolicy: {name} must be one of {valid}, got "
                                 f"{value!r}")
        if self.split_k is not None and (
                isinstance(self.split_k, bool) or not isinstance(self.split_k, int)
                or not 1 <= self.split_k <= MAX_SPLIT_K):
            raise ValueError(f"GroupedGemmPolicy: split_k must be None (automatic) or an "
                             f"integer in [1, {MAX_SPLIT_K}], got {self.split_k!r}")
        if type(self.row_blocks) is not int or self.row_blocks not in (1, 2):
            raise ValueError(f"GroupedGemmPolicy: row_blocks must be 1 or 2, got "
                             f"{self.row_blocks!r}")
        if self.token_stages is not None and (
                type(self.token_stages) is not int
                or not FP8_TOKEN_BUFFERS <= self.token_stages <= MAX_TOKEN_STAGES):
            raise ValueError(f"GroupedGemmPolicy: token_stages must be None (automatic) or an "
                             f"integer in [{FP8_TOKEN_BUFFERS}, {MAX_TOKEN_STAGES}], got "
                             f"{self.token_stages!r}")
        if self.token_codes not in TOKEN_CODES:
            raise ValueError(f"GroupedGemmPolicy: token_codes must be one of {TOKEN_CODES}, "
                             f"got {self.token_codes!r}")
        for name in ("pair_linears", "pdl", "row_norm_in_kernel", "interleaved_split"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GroupedGemmPolicy: {name} must be a bool, got "
                                f"{getattr(self, name)!r}")


def _implementation_items(value) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple(sorted((str(op), impl) for op, impl in items))
    except (TypeError, ValueError):
        raise TypeError(f"KernelPolicy: ops must map op names to implementations, got "
                        f"{value!r}") from None
    for op, impl in pairs:
        op_spec(op)                               # unknown op: ValueError with the valid ones
        check_implementation(op, impl)
        if impl is None:
            raise ValueError(f"KernelPolicy: ops[{op!r}] must be an implementation name; "
                             f"leave the op out for the default")
    return pairs


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which implementation every op runs, and how its kernels are configured.

    implementation: the default of every op: ``"cute"`` (the kernel; raises where it cannot
      run; an op with no kernel runs its reference), ``"xla"`` (the reference) or None (the
      kernel where it runs, else the reference).
    ops: per-op implementations overriding the default, ``{"sparse_attention": "xla"}``
      (a mapping or pairs; stored as sorted pairs so the value stays hashable).
    grouped_gemm: the grouped GEMM's ``GroupedGemmPolicy``.
    sparse_attention: the attention kernel's ``SparseAttentionSm90Config`` (None: its default,
      ``qk_split`` decided per launch). Pinning ``qk_split`` makes launches over a BF16 and an
      FP8 compressed table schedule alike, so their outputs compare bit for bit.
    ffn_sum_in_hc_pre: on one device, each MoE sub-block's output goes to the next mHC pre as
      its parts (``ffi.ffn_sum.FfnSum``: routed rows and shared row), which that op adds --
      the same bits, one XLA launch fewer per layer on a decode step's critical path (on by
      default; docs/performance.md, thirty-first session).
    attention_rope: the heads' RMSNorm, the query RoPE and the output's inverse RoPE inside
      the attention op (``sparse_attention(..., rope=, q_norm_eps=)``: the kernel's prologue
      and epilogue), not three XLA launches around it -- the same bits on the reference.
      Off by default until the GPU times it (docs/performance.md).
    """
    implementation: str | None = None
    ops: tuple[tuple[str, str], ...] = ()
    grouped_gemm: GroupedGemmPolicy = GroupedGemmPolicy()
    sparse_attention: SparseAttentionSm90Config | None = None
    ffn_sum_in_hc_pre: bool = True
    attention_rope: bool = False

    def __post_init__(self):
        if self.implementation not in (None, REFERENCE, KERNEL):
            raise ValueError(f"KernelPolicy: implementation must be {REFERENCE!r}, "
                             f"{KERNEL!r} or None, got {self.implementation!r}")
        object.__setattr__(self, "ops", _implementation_items(self.ops))
        if not isinstance(self.grouped_gemm, GroupedGemmPolicy):
            raise TypeError(f"KernelPolicy: grouped_gemm must be a GroupedGemmPolicy, got "
                            f"{type(self.grouped_gemm).__name__}")
        if not isinstance(self.sparse_attention, (SparseAttentionSm90Config, type(None))):
            raise TypeError(f"KernelPolicy: sparse_attention must be a SparseAttentionSm90Config "
                            f"or None, got {type(self.sparse_attention).__name__}")
        for name in ("ffn_sum_in_hc_pre", "attention_rope"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelPolicy: {name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")

    def implementation_for(self, op: str) -> str | None:
        """The implementation ``op`` runs under this policy (``ops`` first, then the default).

        A default the op does not have (``"cute"`` for an op with no kernel yet) gives its
        reference: the default means "the kernel wherever there is one"."""
        spec = op_spec(op)
        chosen = dict(self.ops).get(op, self.implementation)
        if chosen is not None and chosen not in spec.implementations:
            return REFERENCE
        return chosen

    @classmethod
    def coerce(cls, value) -> "KernelPolicy":
        """A ``KernelPolicy`` from what ``DSV4(implementation=...)`` accepts: None, ``"xla"``,
        ``"cute"``, a mapping of op names to implementations, or a ``KernelPolicy``."""
        if isinstance(value, KernelPolicy):
            return value
        if value is None or isinstance(value, str):
            return cls(implementation=value)
        if isinstance(value, Mapping):
            return cls(ops=value)
        raise TypeError(f"implementation must be None, 'xla', 'cute', a mapping of op names "
                        f"to those, or a KernelPolicy; got {type(value).__name__}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "KernelPolicy":
        """The policy the environment variables describe (see the module docstring); every
        bad value raises one ``ValueError`` naming the variable and the valid values."""
        env = os.environ if environ is None else environ
        default, ops = None, {}
        raw = env.get(IMPLEMENTATION_ENV_VAR, "").strip()
        if raw not in _OFF:
            for item in raw.split(","):
                name, sep, impl = (part.strip() for part in item.partition("="))
                if not sep:
                    name, impl = None, name
                try:
                    if name is None:
                        if impl not in (REFERENCE, KERNEL):
                            raise ValueError(f"the value {impl!r} must be {REFERENCE!r}, "
                                             f"{KERNEL!r} or op=impl pairs")
                        default = impl if default is None else default
                    else:
                        op_spec(name)
                        check_implementation(name, impl)
                        ops[name] = impl
                except ValueError as e:
                    raise ValueError(f"{IMPLEMENTATION_ENV_VAR}={raw!r}: {e}") from None
        gemm = {}
        for var, field in ((ALGORITHM_ENV_VAR, "decode_algorithm"),
                           (PREFILL_ALGORITHM_ENV_VAR, "prefill_algorithm")):
            value = env.get(var, "").strip()
            if value:
                valid = (DECODE_ALGORITHMS if field == "decode_algorithm"
                         else PREFILL_ALGORITHMS)
                if value not in valid:
                    raise ValueError(f"{var}={value!r}: must be one of {valid}")
                gemm[field] = value
        split = env.get(SPLIT_K_ENV_VAR, "").strip()
        if split:
            if not split.isdigit() or not 1 <= int(split) <= MAX_SPLIT_K:
                raise ValueError(f"{SPLIT_K_ENV_VAR}={split!r}: must be an integer in "
                                 f"[1, {MAX_SPLIT_K}]")
            gemm["split_k"] = int(split)
        return cls(implementation=default, ops=ops, grouped_gemm=GroupedGemmPolicy(**gemm))


DEFAULT_POLICY = KernelPolicy()
