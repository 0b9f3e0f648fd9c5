"""The XLA side of the MoE op's Hopper path on CPU: the schedule, the FP8 simulation, the
gathers, the masking of rows no tile covers and the sum into tokens (``moe_experts_cute``,
``moe_expert_rows_cute``), with the kernel launch replaced by a JAX emulation of its
contract (``grouped_gemm_sm90.launch``: tile rows times their expert's weights, SwiGLU x
routing weight when gated; rows outside every tile left unwritten -- NaN here)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import moe_cases
from dsv4_jax import quant
from dsv4_jax.ffi import cases, cute_call as cute_call_module, dispatch, moe as op
from dsv4_jax.ffi import grouped_gemm_sm90 as gemm
from dsv4_jax.ffi import moe_schedule_sm90 as moe_schedule
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support

HIGHEST = jax.lax.Precision.HIGHEST
LIMIT = 10.0


@pytest.fixture(autouse=True)
def schedule_in_xla(monkeypatch):
    """The schedule kernel does not run on CPU: its XLA twin, which it equals bit for bit
    (tests/test_moe_schedule.py), stands in."""
    monkeypatch.setattr(moe_schedule, "schedule_cute", moe_schedule.schedule_xla)


def _row_expert(tile_expert, tile_row0, tile_rows, rows, block_n, groups):
    """The expert of each sorted row by the tiles that cover it (-1: in no tile; the kernels
    drop tiles whose expert is outside [0, groups))."""
    lane = jnp.arange(block_n)
    inside = ((lane[None] < tile_rows[:, None]) & (tile_expert[:, None] >= 0)
              & (tile_expert[:, None] < groups))
    target = jnp.where(inside, tile_row0[:, None] + lane[None], rows)
    return jnp.full((rows,), -1, jnp.int32).at[target.reshape(-1)].set(
        jnp.broadcast_to(tile_expert[:, None], target.shape).reshape(-1), mode="drop")


def emulated_grouped_gemm(xs, tiles, weight, scale, *, weight_b=None, scale_b=None,
                          route_w=None, swiglu_limit=0.0, x_scale=None, config,
                          token_stride=1):
    """The kernel's arithmetic in XLA; the FP8-activation algorithms take e4m3 codes and
    their per-128 scales, whose products are exactly the simulation's bf16 rows, or
    quantise the bf16 rows themselves ("mma_fp8" and "wgmma_rs", which also read row m of the
    tiles from token row m // token_stride)."""
    if token_stride != 1:
        assert config.spec.quantizes_tokens, config
        xs = jnp.repeat(xs, token_stride, axis=0)
    if x_scale is not None:
        xs = (xs.astype(jnp.float32) * jnp.repeat(x_scale, support.BLOCK_K, axis=1)
              ).astype(jnp.bfloat16)
    elif config.spec.quantizes_tokens:
        xs = quant.act_quant_dequant(xs).astype(jnp.bfloat16)
    tile_expert, tile_row0, tile_rows = tiles
    row_expert = _row_expert(tile_expert, tile_row0, tile_rows, xs.shape[0], config.block_n,
                             weight.shape[0])
    expert = jnp.maximum(row_expert, 0)

    def dot(w, s):
        wd = quant.dequant_weight(w[expert], None if s is None else s[expert], jnp.float32)
        return jnp.einsum("ak,ank->an", xs.astype(jnp.float32), wd, precision=HIGHEST,
                          preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    out = dot(weight, scale)
    if weight_b is not None:
        out = (route_w[:, None] * op.swiglu(out, dot(weight_b, scale_b), swiglu_limit)
               ).astype(jnp.bfloat16)
    return jnp.where(row_expert[:, None] >= 0, out, jnp.nan)


def _inputs(fmt, tokens, seed=3):
    p = {n: (jnp.asarray(w), None if s is None else jnp.asarray(s))
         for n, (w, s) in moe_cases.expert_weights(fmt, 0).items()}
    rng = np.random.default_rng(seed + tokens)
    x = jnp.asarray(rng.standard_normal((tokens, moe_cases.D)), jnp.bfloat16)
    idx = np.argsort(rng.random((tokens, moe_cases.E)), axis=1)[:, :moe_cases.K]
    idx[rng.random(idx.shape) < 0.15] = -1                 # dropped assignments
    idx[0] = -1                                            # a token with every one dropped
    w = jnp.asarray(rng.uniform(0.1, 1.0, idx.shape), jnp.float32)
    return x, jnp.asarray(idx, jnp.int32), w, p


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
@pytest.mark.parametrize("tokens, algorithm", [(2, "wgmma"), (3, "mma_sync"), (11, "wgmma"),
                                               (40, "wgmma"), (3, "mma_fp8")],
                         ids=["decode", "decode-mma-sync", "decode-many-tiles", "prefill",
                              "decode-row-tiles"])
def test_kernel_path_glue_matches_the_reference(monkeypatch, fmt, tokens, algorithm):
    monkeypatch.setattr(gemm, "launch", emulated_grouped_gemm)
    if algorithm == "mma_fp8":        # 6 rows over 8 experts: every row a tile of its own
        monkeypatch.setattr(gemm, "ROW_TILE_REPEATS", 10.0)
    x, idx, w, p = _inputs(fmt, tokens)
    for simulate in ((True, False) if fmt != "bf16" else (False,)):
        kw = dict(swiglu_limit=LIMIT, simulate=simulate,
                  policy=GroupedGemmPolicy(decode_algorithm=algorithm))
        ref_kw = dict(swiglu_limit=LIMIT, quantized=fmt != "bf16", simulate=simulate)
        got = jax.jit(lambda x, i, w: op.moe_experts_cute(x, i, w, p["w1"], p["w3"], p["w2"],
                                                          **kw))(x, idx, w)
        want = op.moe_experts_reference(x, idx, w, p["w1"], p["w3"], p["w2"], **ref_kw)
        assert got.shape == (tokens, moe_cases.D) and got.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(got))), "a row outside every tile leaked"
        np.testing.assert_array_equal(np.asarray(got)[0], 0.0)      # all dropped: zero
        # The same bf16 rows (up to a last-bit rounding where the reference's grouped GEMM
        # sums in another order), summed into tokens in another order.
        scale = float(np.abs(np.asarray(want)).mean())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2 ** -7,
                                   atol=2 ** -8 * scale)
        # Row form: assignment order, dropped rows zero.
        xa = jnp.repeat(x, moe_cases.K, axis=0)
        rows = op.moe_expert_rows_cute(xa, idx.reshape(-1), w.reshape(-1), p["w1"], p["w3"],
                                       p["w2"], **kw)
        rows_want = op.moe_expert_rows_reference(xa, idx.reshape(-1), w.reshape(-1),
                                                 p["w1"], p["w3"], p["w2"], **ref_kw)
        np.testing.assert_allclose(np.asarray(rows, np.float32),
                                   np.asarray(rows_want, np.float32), rtol=2 ** -7,
                                   atol=2 ** -8 * scale)
        dropped = np.asarray(idx).reshape(-1) < 0
        np.testing.assert_array_equal(np.asarray(rows, np.float32)[dropped], 0.0)


def test_decode_row_tiles_read_their_tokens_in_the_kernel(monkeypatch):
    """Row tiles on "mma_fp8": the gated launch gets the T token rows and ``token_stride``
    k (no gather of the T k assignment rows before it), and the tiles' groups are the ids as
    routed (no select: the kernel drops ids outside [0, E)); the w2 launch reads its rows
    one to one."""
    seen = []

    def spy(xs, tiles, *args, **kwargs):
        seen.append((xs.shape[0], kwargs.get("token_stride", 1), tiles[0]))
        return emulated_grouped_gemm(xs, tiles, *args, **kwargs)
    monkeypatch.setattr(gemm, "launch", spy)
    monkeypatch.setattr(gemm, "ROW_TILE_REPEATS", 10.0)
    x, idx, w, p = _inputs("fp4", 3)
    policy = GroupedGemmPolicy(decode_algorithm="mma_fp8")
    op.moe_experts_cute(x, idx, w, p["w1"], p["w3"], p["w2"], swiglu_limit=LIMIT,
                        simulate=True, policy=policy)
    (gated_rows, gated_stride, groups), (w2_rows, w2_stride, _) = seen
    assert (gated_rows, gated_stride) == (3, moe_cases.K)
    assert (w2_rows, w2_stride) == (3 * moe_cases.K, 1)
    np.testing.assert_array_equal(np.asarray(groups), np.asarray(idx).reshape(-1))


@pytest.mark.parametrize("tokens, kernels", [(3, ("wgmma_rs", "wgmma_rs")),
                                            (11, ("mma_fp8", "wgmma_rs"))])
def test_auto_gives_each_launch_its_kernel(monkeypatch, tokens, kernels):
    """The default decode algorithm ("auto"): the gated launch of more than AUTO_MAX_ROWS rows
    whose K is too short to split (as here) runs "mma_fp8", the w2 launch of the same rows
    "wgmma_rs", on one schedule; the result is the reference's."""
    seen = []

    def spy(xs, tiles, *args, **kwargs):
        seen.append((kwargs["config"].algorithm, tiles[0].shape))
        return emulated_grouped_gemm(xs, tiles, *args, **kwargs)
    monkeypatch.setattr(gemm, "launch", spy)
    x, idx, w, p = _inputs("fp4", tokens)
    assert (tokens * moe_cases.K > support.AUTO_MAX_ROWS) == (kernels[0] == "mma_fp8")
    got = op.moe_experts_cute(x, idx, w, p["w1"], p["w3"], p["w2"], swiglu_limit=LIMIT,
                              simulate=True, policy=GroupedGemmPolicy())
    want = op.moe_experts_reference(x, idx, w, p["w1"], p["w3"], p["w2"], swiglu_limit=LIMIT,
                                    quantized=True, simulate=True)
    assert tuple(a for a, _ in seen) == kernels
    assert seen[0][1] == seen[1][1]                              # the same tiles
    scale = float(np.abs(np.asarray(want)).mean())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2 ** -7,
                               atol=2 ** -8 * scale)


def test_the_op_picks_the_token_level_kernel_path(monkeypatch):
    """``moe_experts(implementation="cute")`` runs ``moe_experts_cute`` (no per-assignment
    round trip) when the kernel is available; here its launch is the emulation."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weight_b") is not None)
        return emulated_grouped_gemm(*args, **kwargs)
    monkeypatch.setattr(gemm, "launch", spy)
    monkeypatch.setattr(dispatch, "select_implementation", lambda *a: "cute")
    x, idx, w, p = _inputs("fp4", 2)
    idx = jnp.abs(idx)                           # concrete ids must be valid outside jit
    got = op.moe_experts(x, idx, w, p["w1"], p["w3"], p["w2"], swiglu_limit=LIMIT,
                         quantized=True, simulate=True)
    want = op.moe_experts_reference(x, idx, w, p["w1"], p["w3"], p["w2"], swiglu_limit=LIMIT,
                                    quantized=True, simulate=True)
    assert calls == [True, False]                        # gated launch, then w2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_rows_are_summed_per_token_by_a_gather_not_a_scatter_add():
    """``sum_rows_per_token`` undoes any row order and sums each token's k rows in f32; its
    lowering has no scatter-add (atomic on the GPU, so not repeatable bit for bit)."""
    t, k, d = 5, 3, 4
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((t * k, d)).astype(np.float32)
    order = rng.permutation(t * k).astype(np.int32)
    want = rows.reshape(t, k, d).sum(axis=1)
    got = op.sum_rows_per_token(jnp.asarray(rows[order]), jnp.asarray(order), t, k)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(op.sum_rows_per_token(jnp.asarray(rows), None, t, k)),
                               want, rtol=1e-6, atol=1e-6)
    text = jax.jit(op.sum_rows_per_token, static_argnums=(2, 3)).lower(
        jnp.asarray(rows, jnp.bfloat16), jnp.asarray(order), t, k).as_text()
    scatter_bodies = [part.split("})", 1)[0] for part in text.split("stablehlo.scatter")[1:]]
    assert scatter_bodies and not any("stablehlo.add" in body for body in scatter_bodies)


@pytest.mark.parametrize("gated", [True, False])
def test_a_k_split_is_added_in_the_launch(monkeypatch, gated):
    """``grouped_gemm_sm90.launch`` with ``split_k`` > 1: one launch whose splits add their
    sums in the kernel (a cluster per tile) -- the launch asks for the bf16 ``[rows, N]``
    outputs of an unsplit launch with ``split_k`` static, and returns them as they are (no
    XLA sum, no SwiGLU after it). The sums themselves: the GPU tests of the K split."""
    pytest.importorskip("cutlass")       # the launch imports the kernel module
    e, n, k, rows, split = 3, 64, 1024, 7, 4
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 4)
    ws = {name: cases.random_weight("fp4", keys[2 * j], keys[2 * j + 1], e, n, k,
                                    exponents=(-9, -4))
          for j, name in enumerate(("w1", "w3"))}
    ea = jnp.asarray(rng.integers(0, e, rows), jnp.int32)
    order, _, *tiles = gemm.schedule(ea, e, 8)
    xs = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)[order]
    rw = jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32)
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=6, algorithm="mma_sync",
                                           split_k=split)
    sentinel = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)

    def kernel_stand_in(launcher, out_shapes, *_, **static):
        assert static["split_k"] == split and static["gated"] == gated
        assert len(out_shapes) == 1 and out_shapes[0].shape == (rows, n)
        assert out_shapes[0].dtype == jnp.bfloat16
        return (sentinel,)

    monkeypatch.setattr(cute_call_module, "cute_call", kernel_stand_in)
    kw = dict(weight_b=ws["w3"][0], scale_b=ws["w3"][1], route_w=rw,
              swiglu_limit=LIMIT) if gated else {}
    got = gemm.launch(xs, tuple(tiles), *ws["w1"], config=config, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(sentinel, np.float32))
