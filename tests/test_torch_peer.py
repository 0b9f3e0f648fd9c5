"""The torch peer of ``benchmarks/bench_moe.py`` (``benchmarks/torch_peer.py``).

CPU: the offsets / padding helpers and the FLOP count against hand-computed numbers, the
module importing without torch, bench_moe's "torch peer skipped" note when torch is missing,
the peer's table cells. GPU (``gpu``, skipped without torch + CUDA): the peer's two grouped
GEMMs (``torch._scaled_grouped_mm``) at a tiny shape against a NumPy reference on the
dequantised FP8 operands in f32, with and without the SwiGLU glue.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import torch_peer  # noqa: E402


# ----------------------------------------------------------------------------- CPU
def test_padded_offsets_by_hand():
    # groups of 3, 0, 16, 17, 1 rows -> padded to 16, 0, 16, 32, 16
    offs, starts = torch_peer.padded_offsets([3, 0, 16, 17, 1], 16)
    assert offs.dtype == np.int32
    assert offs.tolist() == [16, 16, 32, 64, 80]
    assert starts.tolist() == [0, 16, 16, 32, 64]
    # unpadded: the plain cumulative ends
    offs, starts = torch_peer.padded_offsets([3, 0, 16, 17, 1], 1)
    assert offs.tolist() == [3, 3, 19, 36, 37] and starts.tolist() == [0, 3, 3, 19, 36]
    # 3, 0, 5 rows in multiples of 4 -> 4, 0, 8
    assert torch_peer.padded_offsets([3, 0, 5], 4)[0].tolist() == [4, 4, 12]
    assert torch_peer.padded_offsets([0, 0], 16)[0].tolist() == [0, 0]
    with pytest.raises(ValueError):
        torch_peer.padded_offsets([3, -1], 16)
    with pytest.raises(ValueError):
        torch_peer.padded_offsets([3], 0)


def test_real_rows_and_counts_by_hand():
    # 3, 0, 2 rows padded to 4: rows 0-2 real, 3 padding, 4-5 real, 6-7 padding
    assert torch_peer.real_rows_mask([3, 0, 2], 4).tolist() == [
        True, True, True, False, True, True, False, False]
    assert torch_peer.real_rows_mask([0, 2, 0], 1).tolist() == [True, True]
    # ids [[1, 1], [-1, 4]] over 6 experts: expert 1 twice, expert 4 once, -1 dropped
    counts = torch_peer.expert_counts(np.array([[1, 1], [-1, 4]]), 6)
    assert counts.tolist() == [0, 2, 0, 0, 1, 0]


def test_peer_flops_by_hand():
    from dsv4_jax.ffi import cases
    # the peer's useful FLOPs are cases.moe_flops of its real rows (padding not counted):
    # 37 real rows, d = 256, inter = 128: 2 x 37 x 3 x 256 x 128 = 7 274 496
    counts = [3, 0, 16, 17, 1]
    assert cases.moe_flops(int(sum(counts)), (8, 256, 128, 2)) == 7_274_496


def test_module_imports_without_torch():
    """``torch_peer`` imports, and says why it cannot run, where ``import torch`` fails."""
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, %r)\n"
            "import torch_peer\n"
            "print(torch_peer.unavailable())\n"
            "print(torch_peer.padded_offsets([1, 2], 16)[0].tolist())\n" % BENCH)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("torch not importable (")
    assert out[1] == "[16, 32]"


def test_a_failing_probe_says_why(tmp_path, monkeypatch):
    """``probe_unpadded`` runs in a child: a torch that fails there is a "no", with its
    reason, not an error in the caller."""
    (tmp_path / "torch.py").write_text("raise ImportError('no torch in this child')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ok, line = torch_peer.probe_unpadded(timeout=120)
    assert not ok and line == "ImportError: no torch in this child"


@pytest.fixture
def bench_moe():
    import bench_moe
    return bench_moe


def test_bench_moe_notes_the_skipped_peer(bench_moe, monkeypatch, capsys, tmp_path):
    """Without torch, a whole (dry) run prints one "torch peer skipped" note, writes it with
    the table, and carries on."""
    monkeypatch.setitem(sys.modules, "torch", None)
    out = tmp_path / "table.md"
    bench_moe.main(["--shapes", "tiny", "--tokens", "512", "--routings", "balanced", "--no-xla",
                    "--runs", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("torch peer")]
    assert len(notes) == 1 and notes[0].startswith("torch peer skipped: torch not importable")
    assert notes[0] in out.read_text()
    rows = [line for line in printed.splitlines() if line.startswith("| tiny ")]
    assert len(rows) == 1 and rows[0].count("|") == 20        # 19 columns, peer cells blank


def test_bench_moe_peer_skip_reasons(bench_moe, monkeypatch):
    assert bench_moe.peer_skipped(bench_moe.parse_args(["--no-peer"])) == "--no-peer"
    args = bench_moe.parse_args(["--tokens", "1,64", "--peer-min-tokens", "512"])
    assert bench_moe.peer_skipped(args) == "no token count >= --peer-min-tokens 512"
    monkeypatch.setitem(sys.modules, "torch", None)
    assert bench_moe.peer_skipped(bench_moe.parse_args([])).startswith("torch not importable")
    assert bench_moe.peer_align(bench_moe.parse_args(["--peer-align", "16"])) == (16, None)
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--peer-align", "0"])


def test_peer_cells_by_hand(bench_moe):
    # torch 1000 us for 2e9 useful FLOPs -> 2.0 TF/s; ours 2000 us -> ratio 2.00; 12 padding
    # rows of the 112 executed -> 10.7 %
    row = dict(flops=2e9, torch=1e-3, torch_rows=112.0, torch_real_rows=100.0)
    assert bench_moe.peer_cells(row, 2e-3) == "1000.0 | 2.0 | 2.00 | 10.7%"
    assert bench_moe.peer_cells(row, "n/a") == "1000.0 | 2.0 |  | 10.7%"
    assert bench_moe.peer_cells(dict(torch="oom"), 2e-3) == "oom |  |  | "
    assert bench_moe.peer_cells({}, 2e-3) == " |  |  | "


# ----------------------------------------------------------------------------- GPU
def _reference(runner, inp, counts, out1):
    """NumPy f32 reference of the peer's call on the dequantised FP8 operands: ``(ref1,
    ref2)`` over the real rows (padding rows' references are zero)."""
    import ml_dtypes

    def f32(t):
        return t.float().cpu().numpy()
    offs, starts = torch_peer.padded_offsets(counts, runner.align)
    w13 = f32(runner.w13) * f32(runner.s_w13)[:, :, None]
    w2 = f32(runner.w2) * f32(runner.s_w2)[:, :, None]
    a1 = f32(inp["a1"]) * f32(inp["s_a1"])[:, None]
    if runner.glue:               # SwiGLU with the clamp x row weight, rowwise FP8, on torch's out1
        h = f32(out1)
        g, u = h[:, :runner.inter], h[:, runner.inter:]
        if runner.limit > 0:
            g, u = np.minimum(g, runner.limit), np.clip(u, -runner.limit, runner.limit)
        h = g / (1 + np.exp(-g)) * u * f32(inp["rw"])[:, None]
        scale = np.maximum(np.abs(h).max(axis=1), 1e-12) / torch_peer.FP8_MAX
        q = (h / scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        a2 = q * scale[:, None]
    else:
        a2 = f32(inp["a2"]) * f32(inp["s_a2"])[:, None]
    ref1 = np.zeros((a1.shape[0], w13.shape[1]), np.float32)
    ref2 = np.zeros((a1.shape[0], w2.shape[1]), np.float32)
    for g, (s, c) in enumerate(zip(starts, counts)):
        ref1[s:s + c] = a1[s:s + c] @ w13[g].T
        ref2[s:s + c] = a2[s:s + c] @ w2[g].T
    return ref1, ref2


@pytest.mark.gpu
@pytest.mark.parametrize("glue", [False, True], ids=["gemms", "glue"])
@pytest.mark.parametrize("align", [16, 1])
def test_peer_against_numpy(glue, align):
    pytest.importorskip("torch")
    reason = torch_peer.unavailable()
    if reason is not None:
        pytest.skip(reason)
    if align == 1:
        ok, line = torch_peer.probe_unpadded()
        if not ok:
            pytest.skip(f"this torch does not run unpadded groups: {line}")
    from dsv4_jax.ffi import cases
    dims = (4, 256, 128, 2)                           # E, d, inter, k
    runner = torch_peer.PeerRunner(dims, align=align, glue=glue,
                                   swiglu_limit=cases.SWIGLU_LIMIT, seed=3)
    counts = np.array([5, 0, 16, 21])                 # an empty group, an exact multiple
    inp = runner.inputs(counts)
    assert inp["rows"] == int(torch_peer.padded_offsets(counts, align)[0][-1])
    out1, out2 = runner(inp)
    assert tuple(out1.shape) == (inp["rows"], 2 * 128) and tuple(out2.shape) == (inp["rows"], 256)
    ref1, ref2 = _reference(runner, inp, counts, out1)
    real = torch_peer.real_rows_mask(counts, align)
    got1, got2 = out1.float().cpu().numpy(), out2.float().cpu().numpy()
    assert np.all(np.isfinite(got1)) and np.all(np.isfinite(got2))
    assert not got1[~real].any() and not got2[~real].any()      # zero padding rows stay zero
    from dsv4_jax.ffi.cases import rel_err
    assert rel_err(got1[real], ref1[real]) < 1e-2
    assert rel_err(got2[real], ref2[real]) < 2e-2
    got = torch_peer.time_peer(runner, [counts, counts[::-1]], runs=3)
    assert isinstance(got["seconds"], float) and got["seconds"] > 0
    assert got["real_rows"] == 42
    runner.release()
