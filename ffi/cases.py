"""Named cases of the routed-experts op for the tests and the benchmarks: one definition of
the dims, the random weights of each format, the routings, the token inputs, the figures a
benchmark reports and the check against the op's reference.

* ``DIMS``: ``MoeDims(experts, dim, moe_inter_dim, k)`` by name -- ``"flash"`` and ``"pro"``
  from ``Config.flash()`` / ``Config.pro()``, ``"tiny"`` from ``Config.tiny()`` (CPU runs of
  the reference), ``"small"`` (the smallest GPU case).
* ``random_weight`` / ``expert_weights``: stacked ``[G, out, in]`` weights generated on the
  device, one generator per format (``fp4``, ``fp8``, ``bf16``). The NumPy weights of the
  golden file (``tests/moe_cases.py``) are the only host-side ones.
* ``routing``: test kinds (``TEST_ROUTINGS``) and benchmark kinds (``BENCH_ROUTINGS``).
* ``moe_case`` / ``moe_experts_jit``: a test case's inputs and the op under an implementation
  and policy; ``grouped_launch``: one kernel launch alone, for timing and profiling.
* ``moe_reference_chunked``, ``rel_err``, ``compare_to_reference``,
  ``check_against_reference``: the op's own reference and the one check (finite, repeatable,
  relative error under a tolerance).
* ``bytes_per_group``, ``touched_groups``, ``moe_flops``: the touched-bytes and useful-FLOP
  counts of the benchmark tables.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.config import Config
from . import grouped_gemm_sm90 as gemm
from .moe import moe_experts, moe_experts_reference
from .policy import GroupedGemmPolicy

__all__ = ["MoeDims", "DIMS", "SWIGLU_LIMIT", "FORMATS", "DEFAULT_EXPONENTS", "random_bytes",
           "random_weight", "expert_weights", "shared_expert_weights", "TEST_ROUTINGS",
           "BENCH_ROUTINGS", "routing", "token_inputs", "assignment_rows", "MoeCase",
           "moe_case", "moe_experts_jit", "grouped_launch", "moe_reference_chunked",
           "rel_err", "ReferenceCheck", "compare_to_reference", "check_against_reference",
           "bytes_per_group", "touched_groups", "moe_flops"]


# ----------------------------------------------------------------------------- dims
class MoeDims(NamedTuple):
    """One MoE layer's routed-expert dims: ``experts`` (E), ``dim`` (d), ``moe_inter_dim``
    (inter), ``k`` (experts per token)."""
    experts: int
    dim: int
    moe_inter_dim: int
    k: int

    @classmethod
    def of(cls, cfg: Config) -> "MoeDims":
        return cls(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts)


DIMS = {"tiny": MoeDims.of(Config.tiny()),
        # The smallest dims the GPU cases run: the FP8 kernels need input features that are
        # a multiple of 512 (four 128-wide scale blocks per 4-byte scale word).
        "small": MoeDims(16, 512, 512, 4),
        "flash": MoeDims.of(Config.flash()),
        "pro": MoeDims.of(Config.pro())}
SWIGLU_LIMIT = Config.flash().swiglu_limit
FORMATS = ("fp4", "fp8", "bf16")


def dims_of(dims: str | MoeDims) -> MoeDims:
    """``DIMS[dims]`` for a name, else ``dims`` itself."""
    return DIMS[dims] if isinstance(dims, str) else MoeDims(*dims)


# ----------------------------------------------------------------------------- weights
# Inclusive ranges of the E8M0 scale exponents drawn by default: with random codes they keep
# x W^T of unit-variance rows far from bf16 overflow and underflow at every named dims.
# Callers that need others pass them (the exactness check of benchmarks/moe_kernel_check.py
# spans a wide range; "wgmma_fp8" folds an FP4 row's four scales of a K block into e4m3 codes,
# exact only while they lie within 2^14 of each other).
DEFAULT_EXPONENTS = {"fp4": (-7, -5), "fp8": (-16, -14)}


@functools.partial(jax.jit, static_argnames="shape")
def random_bytes(key, shape):
    """Random uint8 ``shape`` [G, ...], drawn group by group as uint32 words: one draw of the
    whole stack (``jax.random.bits`` of uint8 draws a uint32 per byte) had temporaries of
    several times the stack at Pro dims and ran the GPU out of memory after other cases had
    run in the same process (docs/performance_history.md, "GPU tests, fourth to seventh
    sessions")."""
    g, *rest, n = shape
    words = jax.lax.map(lambda i: jax.random.bits(jax.random.fold_in(key, i), (*rest, n // 4),
                                                  jnp.uint32), jnp.arange(g))
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


def _scales(key, shape, exponents):
    lo, hi = exponents
    e = jax.random.randint(key, shape, lo, hi + 1).astype(jnp.float32)
    return jnp.exp2(e).astype(quant.E8M0_DTYPE)


def random_weight(fmt: str, key_w, key_s, groups: int, out_f: int, in_f: int, *,
                  exponents: tuple[int, int] | None = None):
    """``(weight, scale or None)`` of logical shape ``[groups, out_f, in_f]`` in ``fmt``,
    generated on the device, as bytes where the format is bytes (at Pro dims an f32
    intermediate of one matrix would be tens of GB):

    * ``"fp4"``: random bytes (any byte is two valid e2m1 codes) as int8 ``[G, out, in/2]``,
      E8M0 scales ``[G, out, in/32]``;
    * ``"fp8"``: every e4m3 code but NaN, ``[G, out, in]``, E8M0 scales per 128 x 128 block;
    * ``"bf16"``: normal values scaled by ``in**-0.5``, no scale.

    ``exponents``: inclusive range of the scale exponents (``DEFAULT_EXPONENTS``)."""
    if fmt == "bf16":
        return ((jax.random.normal(key_w, (groups, out_f, in_f), jnp.bfloat16) * in_f ** -0.5
                 ).astype(jnp.bfloat16), None)
    if fmt not in DEFAULT_EXPONENTS:
        raise ValueError(f"random_weight: fmt must be one of {FORMATS}, got {fmt!r}")
    exponents = exponents or DEFAULT_EXPONENTS[fmt]
    if fmt == "fp4":
        w = jax.lax.bitcast_convert_type(random_bytes(key_w, (groups, out_f, in_f // 2)),
                                         jnp.int8)
        return w, _scales(key_s, (groups, out_f, in_f // 32), exponents)
    w = random_bytes(key_w, (groups, out_f, in_f))
    w = jnp.where((w & 0x7F) == 0x7F, w ^ 1, w)        # S.1111.111 (NaN) -> S.1111.110 (448)
    return (jax.lax.bitcast_convert_type(w, quant.FP8_DTYPE),
            _scales(key_s, (groups, -(-out_f // 128), -(-in_f // 128)), exponents))


def expert_weights(dims: str | MoeDims, fmt: str, seed: int = 0, *,
                   exponents: tuple[int, int] | None = None) -> dict:
    """``{"w1": (weight, scale), "w3": ..., "w2": ...}``: w1, w3 ``[E, inter, d]``, w2
    ``[E, d, inter]`` in ``fmt`` (``random_weight``), from ``seed``."""
    e, d, inter, _ = dims_of(dims)
    keys = jax.random.split(jax.random.key(seed), 6)
    return {name: random_weight(fmt, keys[2 * j], keys[2 * j + 1], e, o, i, exponents=exponents)
            for j, (name, (o, i)) in enumerate((("w1", (inter, d)), ("w3", (inter, d)),
                                                ("w2", (d, inter))))}


_SHARED: dict = {}


def shared_expert_weights(dims: str | MoeDims, fmt: str, seed: int = 0) -> dict:
    """``expert_weights``, ready on the device and kept for the next call with the same
    arguments. One set is held: callers run their cases grouped by dims and format, and the
    last set is dropped before the next is drawn (at Pro dims a set is tens of GB)."""
    key = (dims_of(dims), fmt, seed)
    if key not in _SHARED:
        _SHARED.clear()
        _SHARED[key] = jax.block_until_ready(expert_weights(dims, fmt, seed))
    return _SHARED[key]


# ----------------------------------------------------------------------------- routings, tokens
# Test routings: "random" (k distinct experts per token, uniformly), "dropped" (as random,
# about a fifth of the assignments id -1), "one_expert" (every token on expert 3, k = 1),
# "few_experts" (the first max(k, 3) experts hold every row, most experts get none).
TEST_ROUTINGS = ("random", "dropped", "one_expert", "few_experts")
# Benchmark routings: "balanced" (k distinct experts uniformly), "skewed" (expert e picked
# with probability ~ 1/(e+1): a few hot experts); routing weights normalised per token.
BENCH_ROUTINGS = ("balanced", "skewed")


def routing(kind: str, tokens: int, experts: int, k: int, key):
    """``(ids [T, k] int32, routing weights [T, k] f32)`` of one routing ``kind``
    (``TEST_ROUTINGS`` or ``BENCH_ROUTINGS``; ``"one_expert"`` has k = 1)."""
    if kind in BENCH_ROUTINGS:
        ks, kw = jax.random.split(key)
        logits = jax.random.gumbel(ks, (tokens, experts))
        if kind == "skewed":
            logits = logits - jnp.log1p(jnp.arange(experts, dtype=jnp.float32))
        ids = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
        w = jax.random.uniform(kw, (tokens, k), jnp.float32, 0.1, 1.0)
        return ids, w / jnp.sum(w, axis=1, keepdims=True)
    if kind not in TEST_ROUTINGS:
        raise ValueError(f"routing: kind must be one of {TEST_ROUTINGS + BENCH_ROUTINGS}, "
                         f"got {kind!r}")
    k1, k2, k3 = jax.random.split(key, 3)
    if kind == "one_expert":
        idx = jnp.full((tokens, 1), 3, jnp.int32)
    else:
        pool = experts if kind in ("random", "dropped") else max(k, 3)
        scores = jax.random.uniform(k1, (tokens, experts)) + jnp.where(
            jnp.arange(experts) < pool, 1.0, 0.0)
        idx = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
        if kind == "dropped":
            idx = jnp.where(jax.random.uniform(k2, idx.shape) < 0.2, -1, idx)
    return idx, jax.random.uniform(k3, idx.shape, jnp.float32, 0.1, 1.0)


def token_inputs(key, tokens: int, dim: int):
    """``x [T, d]`` bf16: standard normal rows."""
    return jax.random.normal(key, (tokens, dim), jnp.float32).astype(jnp.bfloat16)


def assignment_rows(x, idx, w):
    """The row form of a token-form input: ``(xa [T k, d], ea [T k], wa [T k])``, the rows
    of token ``t`` at ``t k .. t k + k - 1``."""
    t, k = idx.shape
    return jnp.repeat(x, k, axis=0), idx.reshape(-1), w.reshape(-1)


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class MoeCase:
    """One case of ``moe_experts``: its weights, inputs and numerics (``kw``)."""
    dims: MoeDims
    fmt: str
    weights: dict
    x: jax.Array
    idx: jax.Array
    w: jax.Array
    kw: dict

    @property
    def args(self) -> tuple:
        """``moe_experts``'s positional arguments ``(x, idx, w, w1, w3, w2)``."""
        p = self.weights
        return self.x, self.idx, self.w, p["w1"], p["w3"], p["w2"]


def moe_case(dims: str | MoeDims, fmt: str, tokens: int, kind: str, *,
             simulate: bool = True) -> MoeCase:
    """The case ``dims-fmt-tokens-kind`` of the tests: ``shared_expert_weights`` (seed 0),
    routing from key ``1 + T``, tokens from key ``7 + T``; FP8 activation simulation on
    quantised weights when ``simulate``."""
    d = dims_of(dims)
    p = shared_expert_weights(d, fmt)
    idx, w = routing(kind, tokens, d.experts, d.k, jax.random.key(1 + tokens))
    x = token_inputs(jax.random.key(7 + tokens), tokens, d.dim)
    kw = dict(swiglu_limit=SWIGLU_LIMIT, quantized=fmt != "bf16", simulate=simulate)
    return MoeCase(d, fmt, p, x, idx, w, kw)


def moe_experts_jit(implementation: str | None, kw: dict,
                    policy: GroupedGemmPolicy | None = None):
    """``moe_experts`` jitted under ``implementation`` and ``policy`` with numerics ``kw``,
    taking ``MoeCase.args``. The weights are arguments: closed over, jax on the GPU made
    them constants of the program, and compiling GBs of constants was most of a Flash/Pro
    case's time (docs/performance_history.md, "GPU tests, fourth to seventh sessions")."""
    return jax.jit(lambda x, i, w, w1, w3, w2: moe_experts(
        x, i, w, w1, w3, w2, **kw, implementation=implementation, policy=policy))


def grouped_launch(x, group_ids, w, *, config, simulate: bool, w_up=None, row_weights=None,
                   swiglu_limit: float = SWIGLU_LIMIT, presorted: bool = False):
    """One launch of the grouped GEMM alone, set up as the op sets it up (``schedule``,
    ``quantized_rows`` of ``grouped_gemm_sm90``): ``(fn, args)``, ``fn`` jitted, so that a
    timing or a trace of ``fn(*args)`` sees the launch and nothing else. ``fn(*args)`` is the
    rows' outputs in sorted order ``[A, N]`` bf16 (gated with ``w_up``: the SwiGLU x
    ``row_weights`` epilogue). ``presorted``: ``x`` and ``row_weights`` are already in the
    schedule's order (the output of a previous launch)."""
    order, valid, *tiles = gemm.schedule(group_ids, w[0].shape[0], config.block_n)
    xs, x_scale = gemm.quantized_rows(x, None if presorted else order, config, simulate)
    rw = None
    if w_up is not None:
        rw = (jnp.ones(group_ids.shape, jnp.float32) if row_weights is None
              else row_weights.astype(jnp.float32))
        rw = jnp.where(valid, rw if presorted else rw[order], 0.0)

    def run(xs, x_scale, tiles, rw, w, w_up):
        return gemm.launch(xs, tiles, *w, weight_b=None if w_up is None else w_up[0],
                           scale_b=None if w_up is None else w_up[1], route_w=rw,
                           swiglu_limit=swiglu_limit, x_scale=x_scale, config=config)
    return jax.jit(run), (xs, x_scale, tuple(tiles), rw, w, w_up)


# ----------------------------------------------------------------------------- reference check
@functools.lru_cache(maxsize=4)
def _reference_chunk_fn(kw_items):
    """One jitted reference over a chunk of tokens, weights as arguments: compiled once per
    (chunk shape, weights, numerics) and reused by every token count of a (dims, format)."""
    kw = dict(kw_items)
    return jax.jit(lambda x, i, w, w1, w3, w2: moe_experts_reference(x, i, w, w1, w3, w2,
                                                                     **kw))


def moe_reference_chunked(x, idx, w, w1, w3, w2, **kw):
    """``moe_experts_reference`` in chunks of tokens small enough for its gather schedule
    (bounded memory at real dims; same arithmetic up to the f32 summation order). The chunks
    run from a Python loop over one compiled chunk program: a jitted ``lax.map`` over the
    chunks was a new XLA compilation for every token count of a case."""
    (e, inter, d), k = w1[0].shape, idx.shape[1]
    if w1[0].dtype in (jnp.int8, jnp.uint8):
        d *= 2
    fn = _reference_chunk_fn(tuple(sorted(kw.items())))
    if idx.size * inter * d <= 4e8:              # small enough for the reference as it is
        return fn(x, idx, w, w1, w3, w2)
    # Tokens per chunk: fewer rows than experts, and ~0.4 G weight elements gathered.
    chunk = max(1, min((e - 1) // k, int(4e8 // (k * inter * d))))
    t = x.shape[0]
    pad = (-t) % chunk
    xs = jnp.pad(x, ((0, pad), (0, 0)))
    ids = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=-1)
    ws = jnp.pad(w, ((0, pad), (0, 0)))
    outs = [fn(xs[s:s + chunk], ids[s:s + chunk], ws[s:s + chunk], w1, w3, w2)
            for s in range(0, t + pad, chunk)]
    return jnp.concatenate(outs)[:t]


def rel_err(got, want) -> float:
    """``|got - want| / |want|`` (Frobenius norms, float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@dataclasses.dataclass(frozen=True)
class ReferenceCheck:
    """What ``compare_to_reference`` found; ``repeatable`` is None when not asked."""
    rel_err: float
    tol: float
    finite: bool
    repeatable: bool | None

    @property
    def ok(self) -> bool:
        return self.finite and self.repeatable is not False and self.rel_err < self.tol

    def __str__(self) -> str:
        return (f"rel err {self.rel_err:.3e} (tol {self.tol:g}), finite {self.finite}, "
                f"repeatable {self.repeatable}")


def compare_to_reference(got, want, tol: float, *, again=None) -> ReferenceCheck:
    """The check of ``check_against_reference``, reported instead of raised (benchmarks)."""
    got_np = np.asarray(got)
    return ReferenceCheck(rel_err(got, want), tol, bool(np.all(np.isfinite(got_np))),
                          None if again is None else bool(np.array_equal(got_np,
                                                                         np.asarray(again))))


def check_against_reference(got, want, tol: float, *, again=None) -> ReferenceCheck:
    """``AssertionError`` unless ``got`` is finite, equal bit for bit to ``again`` (a second
    call on the same inputs, when given: repeatable and every row written) and within
    relative error ``tol`` of ``want``."""
    got_np = np.asarray(got)
    if not np.all(np.isfinite(got_np)):
        raise AssertionError("NaN/inf in the output")
    if again is not None:
        np.testing.assert_array_equal(got_np, np.asarray(again))
    check = compare_to_reference(got, want, tol, again=again)
    if not check.rel_err < tol:
        raise AssertionError(check.rel_err)
    return check


# ----------------------------------------------------------------------------- benchmark figures
def bytes_per_group(*mats) -> float:
    """Bytes of one group (expert) of the ``(weight, scale or None)`` pairs ``mats``."""
    return sum(int(a.size) * a.dtype.itemsize / a.shape[0] for pair in mats for a in pair
               if a is not None)


def touched_groups(ids) -> int:
    """Distinct groups (experts) that ``ids`` route rows to (ids < 0 are dropped rows)."""
    ids = np.asarray(ids)
    return int(np.unique(ids[ids >= 0]).size)


def moe_flops(rows: int, dims: str | MoeDims, mats: int = 3) -> int:
    """Useful FLOPs of ``rows`` (token, expert) assignments through ``mats`` of the three
    expert matrices: 2 rows d inter each (no padding; T k rows for T tokens)."""
    d = dims_of(dims)
    return 2 * rows * mats * d.dim * d.moe_inter_dim
