"""The Hopper sparse-attention kernel on CPU: it compiles for sm_90a (WGMMA in the PTX), the op
lowers for CUDA to the CuTe custom call, and the kernel disk cache serves a new lowering."""
import re

import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import dispatch, sparse_attention
from dsv4_jax.kernels import sparse_attention_config as support
from dsv4_jax.kernels.sparse_attention_config import SparseAttentionSm90Config as Config

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402

from dsv4_jax.kernels import sparse_attention_sm90_kernel as kernel  # noqa: E402

SCALE = 512 ** -0.5
S = jax.ShapeDtypeStruct
CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall_v2"


def _compile(t, h, k, k2, n, m, splits, config, extra_fp8=False, has_extra_len=False,
             q_prep=False):
    def fake(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, assumed_align=16)
    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    extra = fake(cutlass.Uint8, (m, 584)) if extra_fp8 else fake(bf16, (m, 512))
    tensors = [fake(bf16, (t, h, 512)), fake(bf16, (n, 512)), fake(i32, (t, k)),
               extra, fake(i32, (t, k2)), fake(i32, (t,) if has_extra_len else (1,)),
               fake(f32, (h,)), fake(f32, (t, 32) if q_prep else (1, 1)),
               fake(f32, (t, 32) if q_prep else (1, 1)),
               fake(bf16, (t, h, 512)), fake(f32, (t, h)),
               fake(f32, (splits, t, h, 512) if splits > 1 else (1,)),
               fake(f32, (splits, t, h) if splits > 1 else (1,))]
    return cute.compile(kernel.sparse_attention_launcher, make_fake_stream(), *tensors,
                        num_heads=h, softmax_scale=SCALE, num_splits=splits, has_extra=True,
                        block_n=config.block_n, num_stages=config.num_stages,
                        qk_split=config.qk_split, extra_fp8=extra_fp8,
                        has_extra_len=has_extra_len, q_prep=q_prep,
                        norm_eps=1e-6 if q_prep else 0.0)


VARIANTS = {"single": (1, Config(64, 2, False)), "split": (6, Config(48, 3, False)),
            "qk_split": (1, Config(64, 2, True))}


@pytest.fixture(scope="module")
def compiled():
    """One compile per variant for the whole session: single pass with 64-entry blocks,
    split + combine with 48-entry blocks in three stages, and QK^T split between the math
    warpgroups."""
    return {"single": _compile(64, 128, 128, 1024, 4096, 8192, 1, VARIANTS["single"][1]),
            "split": _compile(2, 64, 128, 512, 1024, 2048, 6, VARIANTS["split"][1]),
            "qk_split": _compile(64, 128, 128, 1024, 4096, 8192, 1, VARIANTS["qk_split"][1])}


@pytest.mark.parametrize("variant", ["single", "split", "qk_split"])
def test_compiles_for_sm90a_with_wgmma(compiled, variant):
    ptx = compiled[variant].artifacts.PTX
    block_n, qk_split = VARIANTS[variant][1].block_n, VARIANTS[variant][1].qk_split
    assert ".target sm_90a" in ptx
    # S = Q K^T: 32 k-steps over the whole block; with QK^T split, each warpgroup's 16
    # (issued at two sites: before the loop and behind the previous block's P.V).
    # O += P V: block_n / 16 k-steps.
    assert len(re.findall(rf"wgmma\.mma_async\S*m64n{block_n}k16", ptx)) == 32
    assert len(re.findall(r"wgmma\.mma_async\S*m64n256k16", ptx)) == block_n // 16
    assert "cp.async.cg.shared.global" in ptx and "setmaxnreg.inc" in ptx
    # The split exchanges fp32 scores in 16 B vectors.
    assert (len(re.findall(r"st\.shared\.v4\.b32", ptx)) >= 8) == qk_split
    assert compiled[variant].dump_to_object("sparse_attention")[:4] == b"\x7fELF"


@pytest.mark.parametrize("splits, config", [(1, Config(64, 2, False)),
                                            (6, Config(48, 3, False))])
def test_fp8_second_pool_compiles_to_copies_and_in_place_widening(splits, config):
    """FP8 entry rows: 8-byte cp.async copies (rows are 8-byte aligned); each block widened
    one block behind its copies (wait for all but the newest group, in the loop; for none,
    after it), each site with a producer barrier and the e4m3 -> f16 conversions of every
    code chunk a thread owns (block_n / 8 rows x 4 chunks x 4 conversions of 2 codes). The
    split QK^T is refused with FP8 rows (it would deadlock against their late commit)."""
    with pytest.raises(ValueError, match="qk_split=True with an FP8 second pool"):
        _compile(2, 64, 128, 512, 1000, 3000, 1, Config(64, 2, True), extra_fp8=True)
    ptx = _compile(2, 64, 128, 512, 1000, 3000, splits, config, extra_fp8=True).artifacts.PTX
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == 2 * config.block_n // 8 * 16
    assert re.search(r"cp\.async\.ca\.shared\.global \[\S+\], \[\S+\], 8;", ptx)
    assert re.search(r"cp\.async\.wait_group\s+1;", ptx)
    assert len(re.findall(r"bar\.sync\s+9, 128;", ptx)) == 2
    assert len(re.findall(rf"wgmma\.mma_async\S*m64n{config.block_n}k16", ptx)) == 32
    assert ".local" not in ptx


@pytest.mark.parametrize("splits, config", [(1, Config(64, 2, True)), (6, Config(48, 3, False))])
def test_bounded_extra_list_reads_each_tokens_bound_once(splits, config):
    """``has_extra_len``: every CTA loads its token's bound (one 4-byte global load more
    than the unbounded build, whose trip count comes from the list's width alone) and the
    kernel still issues the same WGMMAs."""
    def loads(ptx):
        return len(re.findall(r"\bld\.global(?:\.\w+)*\.[bsu]32\s", ptx))

    plain = _compile(2, 64, 128, 512, 1000, 3000, splits, config).artifacts.PTX
    bounded = _compile(2, 64, 128, 512, 1000, 3000, splits, config,
                       has_extra_len=True).artifacts.PTX
    assert loads(bounded) == loads(plain) + 1, (loads(bounded), loads(plain))
    for ptx in (plain, bounded):
        assert len(re.findall(rf"wgmma\.mma_async\S*m64n{config.block_n}k16", ptx)) == 32
        assert ".local" not in ptx


@pytest.mark.parametrize("splits, config", [(1, Config(64, 2, True)), (6, Config(48, 3, False)),
                                            (1, Config(64, 2, False))])
def test_query_preparation_replaces_the_q_copies(splits, config):
    """``q_prep``: the producer issues no Q copies (4 cp.async per thread and 8 rows fewer:
    32 of 16 B), the math warpgroups load their quarter heads (16 loads of 16 B each), meet
    at one more named barrier, and the WGMMAs are the plain build's; the output is rotated
    back in the epilogue or the split merge; nothing in local memory."""
    def copies(ptx):
        return len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))

    plain = _compile(2, 64, 128, 512, 1000, 3000, splits, config).artifacts.PTX
    prep = _compile(2, 64, 128, 512, 1000, 3000, splits, config, q_prep=True).artifacts.PTX
    assert copies(plain) - copies(prep) == 32, (copies(plain), copies(prep))
    assert len(re.findall(r"ld\.global\.nc\.L1::no_allocate\.v4\.b32", prep)) == 16
    assert re.search(r"bar\.sync\s+10, 256;", prep) and not re.search(r"bar\.sync\s+10,",
                                                                        plain)
    for ptx in (plain, prep):
        assert len(re.findall(rf"wgmma\.mma_async\S*m64n{config.block_n}k16", ptx)) == 32
    assert ".local" not in prep


def test_configs_fit_in_shared_memory():
    for config in support.CONFIGS:
        assert config.smem_bytes() <= support.SMEM_BYTES, config
    # QK^T split by default only when the launch has a single split.
    assert support.DEFAULT_CONFIG.resolve() == Config(64, 2, True)
    assert Config(64, 2).resolve(num_splits=6) == Config(64, 2, False)
    assert Config(64, 2, False).resolve() == Config(64, 2, False)
    assert Config(48, 3).resolve() == Config(48, 3, False)
    with pytest.raises(ValueError):
        Config(48, 3, True)   # the exchange buffer would not fit
    with pytest.raises(ValueError):
        Config(32, 4)
    with pytest.raises(ValueError):
        Config(ablation="no_everything")


def test_split_variant_has_the_combine_kernel(compiled):
    assert compiled["split"].artifacts.PTX.count(".entry") == 2
    assert compiled["single"].artifacts.PTX.count(".entry") == 1


@pytest.mark.parametrize("t, h, k, k2, n, m, ok", [
    (1, 64, 128, 512, 10, 10, True), (64, 128, 128, 1024, 10, 10, True),
    (1, 192, 128, 0, 10, 0, True), (1, 48, 128, 0, 10, 0, False), (0, 64, 128, 0, 10, 0, False),
    (1, 64, 0, 512, 10, 10, False), (1, 64, 128, 512, 0, 10, False),
])
def test_support_predicate(t, h, k, k2, n, m, ok):
    config = support.DEFAULT_CONFIG
    got, reason = config.is_supported(dtype="bfloat16", head_dim=512, num_heads=h,
                                      num_tokens=t, window_slots=k, pool_rows=n,
                                      extra_slots=k2, extra_rows=m)
    assert got == ok and (ok or reason)
    assert not config.is_supported(dtype="float16", head_dim=512, num_heads=64, num_tokens=1,
                                   window_slots=1, pool_rows=1)[0]


def test_split_heuristic_fills_the_machine():
    assert support.choose_num_splits(64, 128, 1152) == 1      # 128 CTAs: one wave already
    assert support.choose_num_splits(128, 64, 640) == 1
    # a launch that fills the SMs never splits (a prefill chunk: the partials were gigabytes)
    for t, h, slots in [(4096, 64, 640), (4096, 64, 128 + 1056), (132, 64, 640),
                        (2048, 128, 1152)]:
        assert support.choose_num_splits(t, h, slots) == 1, (t, h, slots)
    for t, h, slots in [(1, 128, 1152), (8, 128, 1152), (1, 64, 640), (8, 64, 640)]:
        splits = support.choose_num_splits(t, h, slots)
        ctas = t * (h // 64) * splits
        assert splits > 1 and ctas <= support.NUM_SMS, (t, h, splits)


def _op_shapes(t=8, h=128, k=128, k2=1024, n=4096, m=8192):
    return (S((t, h, 512), jnp.bfloat16), S((n, 512), jnp.bfloat16), S((t, k), jnp.int32),
            S((h,), jnp.float32), S((m, 512), jnp.bfloat16), S((t, k2), jnp.int32))


def _op(q, kv, idx, sink, extra_kv, extra_idx):
    return sparse_attention(q, kv, idx, sink, extra_kv=extra_kv, extra_idx=extra_idx,
                            scale=SCALE)


def _lower(shapes, f=_op):
    with dispatch.cuda_target():
        return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_op_lowers_to_the_cute_custom_call_for_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    text = _lower(_op_shapes())
    assert f"stablehlo.custom_call @{CUSTOM_CALL}" in text
    assert 'module = "\\7FELF' in text
    # The same function lowered for CPU is the reference: no custom call.
    cpu = jax.jit(_op).trace(*_op_shapes()).lower(lowering_platforms=("cpu",)).as_text()
    assert CUSTOM_CALL not in cpu


def test_op_on_fp8_rows_lowers_to_the_custom_call_reading_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    shapes = list(_op_shapes(t=2, h=64))
    shapes[4] = S((8192, 584), jnp.uint8)
    text = _lower(shapes)
    call = [line for line in text.splitlines() if f"custom_call @{CUSTOM_CALL}" in line]
    assert len(call) == 1 and "tensor<8192x584xui8>" in call[0]
    assert "tensor<8192x512xbf16>" not in text        # no decoded copy of the table


def test_disk_cache_serves_a_new_process_without_recompiling(tmp_path, monkeypatch):
    from dsv4_jax.ffi import cute_call
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    shapes = _op_shapes(t=3, h=64, k=128, k2=512, n=1000, m=3000)
    first = _lower(shapes)
    assert len(list(tmp_path.glob("*.o"))) == 1
    # A new process: nothing in memory, and compiling is not allowed.
    cute_call.clear_memory_caches()

    def no_compile(*a, **k):
        raise AssertionError("recompiled although the disk cache holds the kernel")
    monkeypatch.setattr(cutlass.cute, "compile", no_compile)
    second = _lower(shapes, lambda *a: _op(*a))
    modules = lambda text: re.findall(r'module = "([^"]{0,200})', text)
    assert CUSTOM_CALL in second and modules(first) == modules(second)
