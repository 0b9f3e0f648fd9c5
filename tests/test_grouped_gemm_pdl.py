"""Programmatic dependent launch of the warp kernels (``GroupedGemmSm90Config.pdl``, through
``GroupedGemmPolicy(pdl=True)``): which configs take it and which mode each launch
gets, where the sm_90a build waits for the previous kernel, and -- on the GPU -- that a chain of
the model's launches gives the bits of plain launches. What it saves per pair of launches is
``benchmarks/pdl_probe.py``'s question (docs/performance.md)."""
import dataclasses
import os
import re
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.config import Config
from dsv4_jax.ffi import cases
from dsv4_jax.ffi import grouped_gemm_sm90 as gemm
from dsv4_jax.ffi.grouped_gemm import grouped_gemm, grouped_gemm_pair
from dsv4_jax.ffi.moe import moe_experts
from dsv4_jax.ffi.policy import GroupedGemmPolicy, KernelPolicy
from dsv4_jax.kernels import grouped_gemm_config as support

pytest.importorskip("cutlass")
from grouped_gemm_compile import compile_variant  # noqa: E402
import test_decode_lowering as lowering  # noqa: E402  (its config and lowering of a step)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import pdl_probe  # noqa: E402

BASE = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="mma_fp8", split_k=8)


def test_the_configs_that_take_pdl():
    assert dataclasses.replace(BASE, pdl="weights").pdl == "weights"
    assert dataclasses.replace(BASE, algorithm="mma_sync", token_stages=2, pdl="start").pdl
    for bad in (dict(pdl="later"), dict(algorithm="mma_sync", token_stages=2, pdl="weights"),
                dict(algorithm="wgmma", block_n=64, split_k=1, token_stages=2, pdl="start")):
        with pytest.raises(ValueError, match="pdl must be one of"):
            dataclasses.replace(BASE, **bad)


@pytest.mark.parametrize("pdl", [True, False])
def test_the_policy_gives_each_launch_its_mode(pdl):
    """Decode tiles of the warp kernels take "start" under ``GroupedGemmPolicy(pdl=True)``,
    upgraded to "weights" for the kernels that quantise their tokens ("mma_fp8", "wgmma_rs")
    on constant tiles; prefill tiles and ``pdl=False`` none."""
    policy = GroupedGemmPolicy(pdl=pdl)
    dense = gemm.resolve_config(policy, 8, 1, "fp8", (4096,), True, (2048,))
    routed = gemm.resolve_config(policy, 8 * 6, 256, "fp4", (4096, 2048), True, (2048, 4096),
                                 gated=True)
    wo_a = gemm.resolve_config(policy, 8 * 8, 8, "fp8", (4096,), False, (1024,))
    prefill = gemm.resolve_config(policy, 4096, 1, "fp8", (4096,), True, (2048,))
    assert (dense.algorithm, routed.algorithm, wo_a.algorithm) == ("wgmma_rs", "wgmma_rs",
                                                                   "mma_sync")
    assert routed.split_k == 4                    # "auto": the routed launch of 48 rows splits
    assert prefill.spec.tiles == "any" and prefill.pdl == ""
    want = "start" if pdl else ""
    assert (dense.pdl, routed.pdl, wo_a.pdl) == (want, want, want)
    assert gemm.with_constant_tiles(dense).pdl == ("weights" if pdl else "")
    assert gemm.with_constant_tiles(wo_a).pdl == want       # "mma_sync" reads no weights early


@pytest.mark.parametrize("pdl", [True, False])
def test_the_models_decode_launches_take_their_modes(monkeypatch, pdl):
    """The decode step lowered for Hopper (this CPU machine): under ``pdl=True`` the dense
    FP8 linears (one group, constant tiles) launch "weights", the grouped ``wo_a``
    ("mma_sync") and the routed experts "start"; under ``pdl=False`` every launch is plain."""
    launched = []
    original = gemm.launch

    def record(xs, tiles, weight, scale, **kw):
        launched.append((weight.shape[0], kw["config"].algorithm, kw["config"].pdl))
        return original(xs, tiles, weight, scale, **kw)

    monkeypatch.setattr(gemm, "launch", record)
    lowering._lower(KernelPolicy(grouped_gemm=GroupedGemmPolicy(pdl=pdl)))
    experts = lowering.CFG.n_routed_experts
    assert {groups for groups, _, _ in launched} == {1, lowering.CFG.o_groups, experts}
    for groups, algorithm, mode in launched:
        if not pdl:
            assert mode == ""
        elif groups == 1 and algorithm in ("mma_fp8", "wgmma_rs"):
            assert mode == "weights"
        else:
            assert mode == "start", (groups, algorithm, mode)


def test_pdl_must_be_a_bool():
    with pytest.raises(TypeError, match="pdl must be a bool"):
        GroupedGemmPolicy(pdl="start")


def _ptx(pdl: str, split_k: int) -> str:
    config = dataclasses.replace(BASE, pdl=pdl, split_k=split_k)
    return compile_variant("fp8", True, config, a=8, k=4096, n=2048, e=1).artifacts.PTX


@pytest.mark.parametrize("split_k", [1, 8])
def test_the_build_waits_for_the_previous_kernel_where_its_mode_says(split_k):
    """Off: no grid-dependency instruction. "start": the launch lets the next one begin and
    waits before its first global load. "weights": it issues its first stages' weight copies
    (cp.async) before the wait, and loads token rows only after it."""
    off = _ptx("", split_k)
    assert "griddepcontrol" not in off
    for mode in ("start", "weights"):
        ptx = _ptx(mode, split_k)
        assert ptx.count("griddepcontrol.launch_dependents") == 1
        assert ptx.count("griddepcontrol.wait") == 1
        before = ptx[:ptx.index("griddepcontrol.wait")]
        copies_before = len(re.findall(r"cp\.async\.\w+\.shared\.global", before))
        if mode == "start":
            assert "ld.global" not in before and copies_before == 0
        else:
            assert copies_before > 0
            # token rows (16-byte vector loads of bf16 x) come after the wait only
            assert not re.search(r"ld\.global(?:\.\w+)*\.v4", before)


def test_the_probe_lowers_a_pair_of_launches():
    (n1, k1, gated), (n2, k2) = pdl_probe.pairs(Config.flash(quantized=True))["shared"]
    first, c1 = pdl_probe.launch_fn(1, n1, k1, gated, "weights")
    second, c2 = pdl_probe.launch_fn(1, n2, k2, False, "weights")
    assert (c1.pdl, c2.pdl, c1.algorithm) == ("weights", "weights", "wgmma_rs")
    w = lambda n, k: (jax.ShapeDtypeStruct((1, n, k), jnp.float8_e4m3fn),   # noqa: E731
                      jax.ShapeDtypeStruct((1, n // 128, k // 128), jnp.uint8))
    x = jax.ShapeDtypeStruct((1, k1), jnp.bfloat16)
    text = jax.jit(lambda x, a, b, c: second(first(x, a, b), c, None)).trace(
        x, w(n1, k1), w(n1, k1), w(n2, k2)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall_v2") >= 2


def _chain(policy: GroupedGemmPolicy, steps: int, kw: dict):
    """``steps`` rounds of the model's launch order at decode -- the paired wq_a/wkv launch,
    wq_b on its output, the shared expert's gated w1/w3 and w2, the routed experts -- each
    round's input the last round's output, in one jitted loop (so the launches follow each
    other as in a decode step). The weights are arguments: closed over, GBs of them would
    become constants of the program (``cases.moe_experts_jit``)."""
    gemm_kw = dict(simulate=True, implementation="cute", policy=policy)

    def run(x, dense, idx, route_w, experts):
        def body(_, x):
            q, kv = grouped_gemm_pair(x, None, dense["wq_a"], dense["wkv"], **gemm_kw)
            q = grouped_gemm(q, None, dense["wq_b"], **gemm_kw)
            h = grouped_gemm(x + q[:, :x.shape[1]], None, dense["w1"], w_up=dense["w3"],
                             swiglu_limit=cases.SWIGLU_LIMIT, **gemm_kw)
            y = grouped_gemm(h, None, dense["w2"], **gemm_kw)
            routed = moe_experts(y, idx, route_w, *experts, **kw, implementation="cute",
                                 policy=policy)
            scale = 1.0 / (1.0 + jnp.max(jnp.abs(routed)))       # keep the chain in range
            return (routed * scale).astype(jnp.bfloat16) + kv[:, :1]

        return jax.lax.fori_loop(0, steps, body, x)

    return jax.jit(run)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_a_chain_of_the_model_launches_gives_the_bits_of_plain_launches(tokens):
    """Every launch of the chain runs with its policy mode ("weights" for the dense FP8
    linears, "start" for the routed experts); a launch that read its input before the kernel
    before it had written it would change the bits."""
    case = cases.moe_case("flash", "fp4", tokens, "random")
    d = case.dims.dim
    keys = jax.random.split(jax.random.key(3), 12)
    shapes = {"wq_a": (1024, d), "wkv": (512, d), "wq_b": (32768, 1024),
              "w1": (case.dims.moe_inter_dim, d), "w3": (case.dims.moe_inter_dim, d),
              "w2": (d, case.dims.moe_inter_dim)}
    dense = {name: cases.random_weight("fp8", keys[2 * i], keys[2 * i + 1], 1, n, k)
             for i, (name, (n, k)) in enumerate(shapes.items())}
    args = (case.x.astype(jnp.bfloat16), dense, case.idx, case.w, case.args[3:])
    got = _chain(GroupedGemmPolicy(pdl=True), 4, case.kw)(*args)
    plain = _chain(GroupedGemmPolicy(pdl=False), 4, case.kw)(*args)
    got, plain = np.asarray(got, np.float32), np.asarray(plain, np.float32)
    assert np.all(np.isfinite(got)) and np.any(got != 0)
    np.testing.assert_array_equal(got, plain)
