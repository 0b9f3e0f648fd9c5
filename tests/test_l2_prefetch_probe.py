"""``benchmarks/l2_prefetch_probe.py`` without a GPU: its two kernels compile for sm_90a --
the prefetch launch issues one bulk L2 prefetch per thread, the spin reads the global timer
-- and its steps lower for CUDA to CuTe custom calls."""
import os
import re
import sys

import pytest

import jax
import jax.numpy as jnp

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402

import l2_prefetch_probe as probe  # noqa: E402

CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall_v2"


def _fake(dtype, shape):
    return make_fake_compact_tensor(dtype, shape, assumed_align=16)


def test_the_prefetch_kernel_issues_one_bulk_prefetch_per_thread():
    nbytes, piece = 1000000, 16384
    compiled = cute.compile(probe.l2_prefetch_launcher, make_fake_stream(),
                            _fake(cutlass.Uint8, (nbytes,)), _fake(cutlass.Int32, (1,)),
                            _fake(cutlass.Int32, (1,)), nbytes=nbytes, piece=piece)
    ptx = compiled.artifacts.PTX
    assert ".target sm_90a" in ptx
    assert len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[", ptx)) == 1
    # one thread per piece, rounded up to whole CTAs
    assert probe.L2PrefetchSm90(nbytes, piece).ctas == -(-nbytes // (piece * probe.THREADS))
    with pytest.raises(ValueError, match="piece must be a positive multiple of 16"):
        probe.L2PrefetchSm90(nbytes, 24)


def test_the_spin_kernel_reads_the_global_timer():
    compiled = cute.compile(probe.spin_launcher, make_fake_stream(), _fake(cutlass.Int32, (1,)),
                            _fake(cutlass.Int32, (1,)), ns=5000)
    assert "%globaltimer" in compiled.artifacts.PTX


def test_the_steps_lower_to_custom_calls():
    token = jnp.zeros((1,), jnp.int32)
    weight = jnp.zeros((256, 512), jnp.float8_e4m3fn)

    def steps(tok, w):
        return probe.spin(probe.prefetch([w], tok, 16384), 5.0)

    text = jax.jit(steps).trace(token, weight).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(CUSTOM_CALL) >= 2
    assert probe.spin(token, 0) is token                    # no gap: no launch
