"""Does an L2 prefetch issued before a gap make the next decode GEMM launch faster?

    source .device/setup.sh && python3 benchmarks/l2_prefetch_probe.py [--gaps 0,5,20,40]

Measured (docs/performance.md, seventeenth session's decode section): it does not -- the
prefetch launch holds the stream for 6-11 us per 33.6 MB, and the GEMM after it is no faster.

One jitted loop of ``--iters`` iterations, each: write a 256 MiB buffer (the L2 holds none of
the weight afterwards), [prefetch the weight's bytes into the L2], spin ``gap`` us on one CTA
(the XLA glue between two GEMMs of a decode step, which uses little HBM), then the GEMM at
T = 1 (``grouped_gemm``, the model's decode kernel). Every step takes the previous one's
output, so they run in this order. Device time of each kernel from a traced run
(``step_figures.trace_device_ops``), per iteration: the GEMM with and without the prefetch
is the answer; the prefetch launch's own time is its cost.
"""
from __future__ import annotations

import argparse
import sys

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dsv4_jax.config import Config
from dsv4_jax.ffi import cases, grouped_gemm
from dsv4_jax.ffi.cute_call import cute_call
from decode_gemms import gemm_shapes
from step_figures import trace_device_ops

FLUSH_WORDS = 64 * 2 ** 20            # f32: 256 MiB
# The prefetch launch (benchmark only: the probe found it does not pay, docs/performance.md):
# thread i issues one cp.async.bulk.prefetch.L2.global of bytes [i piece, (i + 1) piece) of
# the array (the last piece cut to the end, rounded down to 16 bytes); thread 0 copies the
# token, which orders the launch among the loop's steps.
THREADS = 128


@dsl_user_op
def prefetch_l2(addr: Int64, size: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.prefetch.L2.global``: ``size`` bytes (a multiple of 16) at the
    16-byte aligned global address ``addr`` into the L2; nothing to wait for."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip),
                           Int32(size).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class L2PrefetchSm90:
    """Static configuration: ``nbytes`` of the array, ``piece`` bytes per thread."""

    def __init__(self, nbytes: int, piece: int):
        if piece % 16 or piece <= 0:
            raise ValueError(f"L2PrefetchSm90: piece must be a positive multiple of 16, got "
                             f"{piece}")
        self.nbytes = nbytes
        self.piece = piece
        self.ctas = max(1, -(-nbytes // (piece * THREADS)))

    @cute.jit
    def __call__(self, mBytes: cute.Tensor, mTokenIn: cute.Tensor, mTokenOut: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mBytes, mTokenIn, mTokenOut).launch(
            grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mBytes: cute.Tensor, mTokenIn: cute.Tensor, mTokenOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        start = i.to(Int64) * self.piece
        if start < self.nbytes:
            size = Int64(self.nbytes) - start
            if size > self.piece:
                size = Int64(self.piece)
            size = (size // 16) * 16
            if size > 0:
                prefetch_l2(mBytes.iterator.toint() + start, size.to(Int32))
        if i == 0:
            mTokenOut[0] = mTokenIn[0]


@cute.jit
def l2_prefetch_launcher(stream: cuda.CUstream, data: cute.Tensor, token: cute.Tensor,
                         token_out: cute.Tensor, *, nbytes: cutlass.Constexpr,
                         piece: cutlass.Constexpr):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    L2PrefetchSm90(nbytes, piece)(data, token, token_out, stream)


@dsl_user_op
def _global_timer(*, loc=None, ip=None) -> Int64:
    return Int64(llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.kernel
def _spin_kernel(mIn: cute.Tensor, mOut: cute.Tensor, ns: cutlass.Constexpr):
    """One CTA spins ``ns`` nanoseconds (the glue between two GEMMs), then copies the token."""
    start = _global_timer()
    now = start
    while now - start < ns:
        now = _global_timer()
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        mOut[0] = mIn[0]


@cute.jit
def spin_launcher(stream: cuda.CUstream, token: cute.Tensor, token_out: cute.Tensor, *,
                  ns: cutlass.Constexpr):
    _spin_kernel(token, token_out, ns).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


def spin(token, us: float):
    """The token after ``us`` microseconds of one spinning CTA (none for ``us <= 0``)."""
    if us <= 0:
        return token
    return cute_call(spin_launcher, (jax.ShapeDtypeStruct((1,), jnp.int32),), token,
                     ns=int(us * 1000))[0]


def prefetch(arrays, token, piece: int):
    """The token after one prefetch launch per array (its bytes, ``piece`` per thread)."""
    for a in arrays:
        data = jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
        token = cute_call(l2_prefetch_launcher, (jax.ShapeDtypeStruct((1,), jnp.int32),),
                          data, token, nbytes=int(data.size), piece=piece)[0]
    return token


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gaps", default="0,5,20,40")
    p.add_argument("--gemms", default="wo_b,wq_b,shared_w13")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--piece", type=int, default=16384)
    p.add_argument("--warm", action="store_true",
                   help="no buffer write: the weight stays in the L2 from the last iteration")
    a = p.parse_args(argv)
    # The Flash layer's dense FP8 GEMMs of one group (decode_gemms.gemm_shapes).
    shapes = {name: s for name, s in gemm_shapes(Config.flash(quantized=True)).items()
              if s.groups == 1 and s.fmt == "fp8"}
    unknown = [g for g in a.gemms.split(",") if g not in shapes]
    if unknown:
        p.error(f"--gemms: {unknown} not among {sorted(shapes)}")
    print(f"# l2_prefetch_probe, {jax.devices()[0].device_kind}, `{' '.join(sys.argv)}`")
    print("| gemm | MB | gap (us) | prefetch | GEMM (us) | prefetch launch (us) | spin (us) |")
    print("|---|---|---|---|---|---|---|")
    key = jax.random.PRNGKey(0)
    for index, name in enumerate(a.gemms.split(",")):
        n, k, gated = shapes[name].n, shapes[name].k, shapes[name].gated
        ks = jax.random.split(jax.random.fold_in(key, index), 5)
        w = cases.random_weight("fp8", ks[0], ks[1], 1, n, k)
        up = cases.random_weight("fp8", ks[2], ks[3], 1, n, k) if gated else None
        x = cases.token_inputs(ks[4], 1, k)
        mats = [w] + ([up] if gated else [])
        arrays = [m for pair in mats for m in pair]
        mb = sum(v.size * v.dtype.itemsize for v in arrays) / 1e6
        for gap in [float(g) for g in a.gaps.split(",")]:
            for pf in (False, True):
                def body(i, carry):
                    flush, token = carry
                    if not a.warm:
                        flush = flush + 1.0
                    token = token + (flush[0] > 1e30).astype(jnp.int32)
                    if pf:
                        token = prefetch(arrays, token, a.piece)
                    token = spin(token, gap)
                    xi = jnp.where(token[0] == 123456789, x * 2, x)
                    y = grouped_gemm(xi, None, w, w_up=up, simulate=True,
                                     implementation="cute")
                    return flush, token + (y[0, 0] > 1e30).astype(jnp.int32)

                run = jax.jit(lambda c: jax.lax.fori_loop(0, a.iters, body, c))
                carry = (jnp.zeros((FLUSH_WORDS,), jnp.float32), jnp.zeros((1,), jnp.int32))
                jax.block_until_ready(run(carry))
                totals, _ = trace_device_ops(lambda: jax.block_until_ready(run(carry)))
                per = lambda part: sum(t for nm, t in totals.items() if part in nm) / a.iters
                print(f"| {name} | {mb:.1f} | {gap:g} | {'yes' if pf else 'no'} | "
                      f"{per('GroupedGemm'):.2f} | {per('L2Prefetch') if pf else 0:.2f} | "
                      f"{per('spin'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
