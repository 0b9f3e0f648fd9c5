"""The routed experts' schedule (``ffi/moe_schedule_sm90.py``): the kernel's limits, its sm_90a
compile on CPU, the choice between the kernel and XLA in the MoE op's lowering, and -- on the
GPU -- the kernel's arrays equal to XLA's bit for bit."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import dispatch, grouped_gemm_sm90 as gemm, moe_schedule_sm90 as schedule
from dsv4_jax.kernels import moe_schedule_config as limits
from dsv4_jax.kernels.grouped_gemm_config import num_tile_slots


def _ids(rows, groups, seed, dropped=0.1, spread=None):
    """Routed ids: ``spread`` groups used (None: all), a share of them dropped (-1 or >= G)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, spread or groups, rows)
    drop = rng.random(rows) < dropped
    ids[drop] = rng.choice([-1, groups, groups + 5], drop.sum())
    return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("rows, groups, ok, reason", [
    (48, 256, True, ""), (limits.MAX_ROWS, 384, True, ""),
    (limits.MAX_ROWS + 1, 256, False, f"{limits.MAX_ROWS + 1} rows"),
    (0, 256, False, "0 rows"), (48, limits.THREADS, False, f"{limits.THREADS} groups")])
def test_supports_names_what_the_kernel_does_not_take(rows, groups, ok, reason):
    got_ok, why = limits.supports(rows, groups)
    assert got_ok == ok and reason in why


def test_the_xla_twin_gives_the_inverse_order():
    ids = _ids(40, 8, seed=1)
    order, position, valid, *tiles = schedule.schedule_xla(ids, 8, 8)
    want_order, want_valid, *want_tiles = gemm.schedule(ids, 8, 8)
    np.testing.assert_array_equal(order, want_order)
    np.testing.assert_array_equal(valid, want_valid)
    np.testing.assert_array_equal(np.asarray(position)[np.asarray(order)], np.arange(40))
    for got, want in zip(tiles, want_tiles):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows, groups", [(48, 256), (limits.MAX_ROWS + 8, 256)])
def test_decode_sizes_lower_to_one_launch(rows, groups):
    """Up to MAX_ROWS rows the schedule is the kernel's one custom call (no sort); past it,
    XLA's sort."""
    text = jax.jit(lambda i: schedule.sorted_schedule(i, groups, 8))
    with dispatch.cuda_target():
        text = text.trace(jax.ShapeDtypeStruct((rows,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    kernel = rows <= limits.MAX_ROWS
    assert ("MoeScheduleSm90" in text) == kernel
    assert ("stablehlo.sort" in text) != kernel


@pytest.mark.parametrize("rows, groups, block_n", [(48, 256, 8), (512, 384, 64), (3, 8, 8)])
def test_kernel_compiles_for_sm90a(rows, groups, block_n):
    """One CTA: keys and counts (shared-memory atomics), two block scans by shuffles, the
    stable ranks, the tiles; five CTA barriers; nothing in local memory."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import moe_schedule_sm90 as kernel
    slots = num_tile_slots(rows, groups, block_n)
    fake = lambda n: make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=16)  # noqa
    ptx = cute.compile(kernel.moe_schedule_launcher, make_fake_stream(), fake(rows),
                       fake(rows), fake(rows), fake(rows), fake(slots), fake(slots),
                       fake(slots), rows=rows, groups=groups, block_n=block_n,
                       slots=slots).artifacts.PTX
    assert ".target sm_90a" in ptx and ".local" not in ptx
    assert ptx.count("atom.shared.cta.add") == 1
    assert ptx.count("shfl.sync.up") == 2 * 2 * 5        # two scans, in warps and over warps
    assert ptx.count("bar.sync") == 5


@pytest.mark.gpu
@pytest.mark.parametrize("rows, groups, block_n, spread, dropped", [
    (48, 256, 8, None, 0.1), (384, 256, 8, None, 0.1), (384, 256, 8, 3, 0.0),
    (limits.MAX_ROWS, 384, 64, None, 0.2), (limits.MAX_ROWS, 384, 16, 1, 0.0),
    (18, 256, 8, None, 1.0), (7, 8, 8, None, 0.3), (1, 1, 8, None, 0.0),
    (200, 1000, 128, 40, 0.05)],
    ids=["flash-b8", "flash-b64", "few-experts", "pro-max", "one-expert", "all-dropped",
         "tiny", "one-row", "many-groups"])
def test_kernel_equals_xla_bit_for_bit(rows, groups, block_n, spread, dropped):
    ids = _ids(rows, groups, seed=rows + groups, dropped=dropped, spread=spread)
    got = jax.jit(lambda i: schedule.schedule_cute(i, groups, block_n))(ids)
    want = jax.jit(lambda i: schedule.schedule_xla(i, groups, block_n))(ids)
    for name, g, w in zip(("order", "position", "valid", "tile_group", "tile_row0",
                           "tile_rows"), got, want):
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
