"""The named cases of ``dsv4_jax.ffi.cases`` (shared by the MoE tests and benchmarks): dims
from the configs, the weight generators' formats and scale ranges, the routings, the
reference check, and the launch alone lowering for the GPU on CPU."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax import quant
from dsv4_jax.ffi import cases
from dsv4_jax.ffi.dispatch import cuda_target
from dsv4_jax.ffi.moe_sm90 import moe_configs
from dsv4_jax.ffi.policy import GroupedGemmPolicy


def test_named_dims_come_from_the_configs():
    for name, cfg in (("tiny", dj.Config.tiny()), ("flash", dj.Config.flash()),
                      ("pro", dj.Config.pro())):
        assert cases.DIMS[name] == (cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim,
                                    cfg.n_activated_experts)
    assert cases.SWIGLU_LIMIT == dj.Config.flash().swiglu_limit


@pytest.mark.parametrize("fmt", cases.FORMATS)
def test_each_format_generator_gives_the_op_format_and_its_scale_range(fmt):
    keys = jax.random.split(jax.random.key(0))
    exponents = (-3, 2)
    w, s = cases.random_weight(fmt, *keys, 3, 256, 512, exponents=exponents)
    assert quant.weight_format(w, s).name == fmt
    values = np.asarray(quant.dequant_weight(w, s, jnp.float32))
    assert values.shape == (3, 256, 512) and np.all(np.isfinite(values))
    if s is not None:
        e = np.log2(np.asarray(s.astype(jnp.float32)))
        assert e.min() == exponents[0] and e.max() == exponents[1]
    if fmt == "fp8":
        assert np.abs(values).max() / np.exp2(exponents[1]) <= 448


def test_expert_weights_are_the_three_matrices_of_the_dims():
    p = cases.expert_weights("tiny", "fp4")
    e, d, inter, _ = cases.DIMS["tiny"]
    assert [p[n][0].shape for n in ("w1", "w3", "w2")] == [(e, inter, d // 2)] * 2 + [
        (e, d, inter // 2)]
    assert cases.shared_expert_weights("tiny", "fp4") is cases.shared_expert_weights("tiny",
                                                                                     "fp4")


@pytest.mark.parametrize("kind", cases.TEST_ROUTINGS + cases.BENCH_ROUTINGS)
def test_routings(kind):
    idx, w = cases.routing(kind, 16, 8, 2, jax.random.key(0))
    idx = np.asarray(idx)
    assert idx.shape == w.shape == (16, 1 if kind == "one_expert" else 2)
    valid = idx[idx >= 0]
    assert valid.size and valid.max() < 8
    if kind == "few_experts":
        assert cases.touched_groups(idx) <= 3
    if kind in cases.BENCH_ROUTINGS:
        np.testing.assert_allclose(np.asarray(w).sum(axis=1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="kind must be one of"):
        cases.routing("uniform", 4, 8, 2, jax.random.key(0))


def test_the_reference_check_names_what_failed():
    want = np.ones((4, 3), np.float32)
    assert cases.check_against_reference(want * (1 + 1e-4), want, 1e-2, again=want *
                                         (1 + 1e-4)).ok
    with pytest.raises(AssertionError, match="NaN/inf"):
        cases.check_against_reference(np.full_like(want, np.nan), want, 1e-2)
    with pytest.raises(AssertionError):
        cases.check_against_reference(want, want, 1e-2, again=want + 1)
    with pytest.raises(AssertionError, match="0.5"):
        cases.check_against_reference(want * 1.5, want, 1e-2)
    report = cases.compare_to_reference(want * 1.5, want, 1e-2, again=want)
    assert not report.ok and report.finite and report.repeatable is False


def test_benchmark_figures():
    p = cases.expert_weights("tiny", "fp4")
    e, d, inter, k = cases.DIMS["tiny"]
    assert cases.bytes_per_group(p["w1"]) == inter * d // 2 + inter * d // 32
    assert cases.moe_flops(5, "tiny") == 2 * 5 * 3 * d * inter
    assert cases.touched_groups(np.array([[1, 1], [-1, 4]])) == 2


def test_the_launch_alone_lowers_for_the_gpu():
    """``grouped_launch`` (the benchmarks' launch alone) traces and lowers to the kernel's
    custom call on CPU, gated and ungated, with the op's own config."""
    pytest.importorskip("cutlass")
    case = cases.moe_case("tiny", "fp4", 3, "random")
    p = case.weights
    xa, ea, wa = cases.assignment_rows(case.x, case.idx, case.w)
    up_config, down_config = moe_configs(ea.size, p["w1"], p["w2"], simulate=True,
                                         policy=GroupedGemmPolicy())
    with cuda_target():
        up, args = cases.grouped_launch(xa, ea, p["w1"], w_up=p["w3"], row_weights=wa,
                                        config=up_config, simulate=True)
        h = jax.eval_shape(up, *args)
        down, down_args = cases.grouped_launch(jnp.zeros(h.shape, h.dtype), ea, p["w2"],
                                               config=down_config, simulate=True, presorted=True)
        for fn, a in ((up, args), (down, down_args)):
            text = fn.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
            assert "GroupedGemm" in text
