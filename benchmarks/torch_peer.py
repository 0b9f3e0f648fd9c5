"""The torch peer of ``bench_moe.py``: the routed experts' two grouped GEMMs through PyTorch's
FP8 grouped GEMM, ``torch._scaled_grouped_mm``, timed in the same process as our op.

What one peer call computes (one MoE layer's routed experts, rows already sorted by expert):

    out1 = _scaled_grouped_mm(a1, w13.transpose(-2, -1), s_a1, s_w13, offs)   [M, 2 inter] bf16
    out2 = _scaled_grouped_mm(a2, w2.transpose(-2, -1),  s_a2, s_w2,  offs)   [M, d] bf16

* ``a1`` [M, d] FP8 e4m3, row-major, with rowwise f32 scales ``s_a1`` [M]: the T k
  (token, expert) rows of one routing, grouped by expert (group g holds ``counts[g]`` rows);
* ``w13`` [E, 2 inter, d] FP8 (w1 and w3 stacked: the gated GEMM's output holds the gate in
  columns ``[0, inter)`` and the up projection in ``[inter, 2 inter)``), ``w2`` [E, d, inter]
  FP8, both contiguous ``[G, N, K]``; ``w.transpose(-2, -1)`` is the column-major ``[G, K, N]``
  operand the op asks for; rowwise (per output channel) f32 scales ``s_w13`` [E, 2 inter],
  ``s_w2`` [E, d];
* ``offs`` int32 [E]: the cumulative ends of the groups' rows;
* ``a2`` [M, inter] FP8 with scales ``s_a2`` [M]: by default an input made beforehand (the
  two GEMMs only, as the 2026-11-24 peer figures); with ``glue=True`` it is computed and timed
  between the GEMMs in plain torch ops: SwiGLU with DSV4's clamp (``silu(min(g, l)) *
  clip(u, -l, l)``) times the row's routing weight, then a rowwise FP8 quantisation (amax /
  448). Not timed in either mode: the gather of token rows into expert order, the FP8
  quantisation of ``a1``, the scatter back and the per-token sum -- all of which our op's time
  includes.

Weights are FP8 whatever ``bench_moe.py --weights`` says (the op has no FP4 path on sm_90),
random normal values; rowwise scales, not DSV4's 128 x 128 blocks; the values do not change
the work.

The call's conventions (PyTorch ``aten/src/ATen/native/cuda/GroupedBlas.cpp``,
``_scaled_grouped_mm_cuda``; ``test/test_matmul_cuda.py``, ``test_scaled_grouped_gemm_2d_3d``;
``torchao/prototype/moe_training/scaled_grouped_mm.py``): 2D x 3D needs ``offs``; ``mat_a``
not transposed, ``mat_b`` transposed (column-major); K and N multiples of 16; scale_a 1-D of
length M, scale_b 2-D [G, N] contiguous in its last dim; f32 scales select the rowwise FP8
kernel (a CUTLASS sm_90 ptr-array grouped GEMM, fewer than 1024 groups), which multiplies
the f32 accumulator by scale_a[row] * scale_b[g, col]; bf16 output only; sm_90 / sm_100.
``use_fast_accum=True`` by default (FP8 WGMMA accumulation without promotion, as torchao's
forward calls it; ``fast_accum=False`` / ``bench_moe.py --peer-accum precise`` for the other).

Padding: older releases (``GroupMMCommon.cuh`` before the alignment check was refined)
assert on the device that every group's row count is a multiple of 16 -- a failed device
assert would end the process's CUDA context, ours included. ``probe_unpadded`` therefore
tries groups of 5, 0, 16, 21 and 3 rows in a child process (checked against an f32
reference); where that fails, each group's rows are padded to ``align`` = 16. Padded rows
are zero inputs that the GEMMs compute anyway; the FLOP figures count only the real rows
(``cases.moe_flops``: 2 rows 3 d inter), and ``padded_offsets`` says how
many rows were executed.

Timing (``PeerRunner.seconds``), mirroring ``timing.median_seconds`` with ``calls_on_sets``:
R input sets (own rows, routing counts and offsets; the same routings as our op's sets), so
consecutive calls touch different activations; two warm-up executions; then ``runs``
executions, each: synchronise, record a CUDA event, issue the R calls back to back, record an
event, wait for it; the median event time over the executions divided by R is the time per
call. The events bracket the GPU work from the first launch to the last (host time between
launches counts where the GPU waits for it, as our wall-clock intervals count dispatch).

torch is imported inside the functions that need it: this module imports without torch, and
``unavailable()`` says why the peer cannot run.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import numpy as np

_HERE = os.path.abspath(__file__)

ALIGN = 16              # rows per group: a multiple of this (older torch asserts it)
FP8_MAX = 448.0         # largest finite e4m3 value


# ----------------------------------------------------------------------------- pure numpy
def expert_counts(ids, experts: int) -> np.ndarray:
    """Rows per expert ``[E]`` int64 of a routing's ids ``[T, k]`` (ids < 0: dropped rows)."""
    ids = np.asarray(ids).reshape(-1)
    return np.bincount(ids[ids >= 0], minlength=experts).astype(np.int64)


def padded_offsets(counts, align: int = ALIGN) -> tuple[np.ndarray, np.ndarray]:
    """``(offs, starts)`` of groups with ``counts`` real rows, each padded up to a multiple of
    ``align`` rows: ``offs`` int32 [G], the cumulative ends (``_scaled_grouped_mm``'s
    ``offs``; ``offs[-1]`` is the rows executed), ``starts`` int64 [G], where each group's
    real rows begin (they fill ``starts[g] : starts[g] + counts[g]``, padding follows)."""
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 1 or (counts < 0).any() or align < 1:
        raise ValueError(f"padded_offsets: counts must be 1-D, >= 0 and align >= 1, got "
                         f"{counts!r}, align {align}")
    padded = -(-counts // align) * align
    ends = np.cumsum(padded)
    if ends.size and ends[-1] >= 2 ** 31:
        raise ValueError(f"padded_offsets: {ends[-1]} rows do not fit int32 offsets")
    return ends.astype(np.int32), ends - padded


def real_rows_mask(counts, align: int = ALIGN) -> np.ndarray:
    """bool ``[offs[-1]]``: which of the executed rows are real (not padding)."""
    offs, starts = padded_offsets(counts, align)
    total = int(offs[-1]) if offs.size else 0
    rows = np.arange(total)
    group = np.searchsorted(offs, rows, side="right")
    return rows - starts[group] < np.asarray(counts, np.int64)[group]


# ----------------------------------------------------------------------------- torch
def unavailable() -> str | None:
    """Why the peer cannot run here (None: it can): torch missing, no CUDA device, no
    ``torch._scaled_grouped_mm``, or a device other than sm_90 / sm_100."""
    try:
        import torch
    except Exception as err:          # ImportError, or a broken install
        return f"torch not importable ({type(err).__name__}: {err})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return (f"torch._scaled_grouped_mm runs on compute capability 9.x/10.x, the device is "
                f"{major}.{minor}")
    return None


def probe_unpadded(timeout: float = 300) -> tuple[bool, str]:
    """Whether the installed torch runs groups whose row counts are not multiples of 16
    (and gets them right): ``(ok, the child's last line)``. The try runs in a child process,
    so that a failed device assert ends that process's CUDA context, not ours."""
    try:
        r = subprocess.run([sys.executable, _HERE, "--probe-unpadded"], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"the probe took over {timeout:.0f} s"
    ok = r.returncode == 0
    out, err = r.stdout.strip().splitlines(), r.stderr.strip().splitlines()
    lines = (out or err) if ok else (err or out)          # the result, or the error's end
    return ok, (lines[-1][:200] if lines else f"exit status {r.returncode}")


def _probe_unpadded_child() -> int:
    """The child of ``probe_unpadded``: one ``_scaled_grouped_mm`` on groups of 5, 0, 16, 21
    and 3 rows against the f32 product of the dequantised operands."""
    import torch
    counts, k, n, dev = [5, 0, 16, 21, 3], 256, 128, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    m, e = sum(counts), len(counts)
    a = torch.randn(m, k, generator=gen, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(e, n, k, generator=gen, device=dev).to(torch.float8_e4m3fn)
    s_a = torch.rand(m, generator=gen, device=dev) + 0.5
    s_w = torch.rand(e, n, generator=gen, device=dev) + 0.5
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
    out = torch._scaled_grouped_mm(a, w.transpose(-2, -1), s_a, s_w, offs=offs,
                                   out_dtype=torch.bfloat16).float()
    ref, start = torch.zeros(m, n, device=dev), 0
    for g, c in enumerate(counts):
        ref[start:start + c] = ((a[start:start + c].float() * s_a[start:start + c, None])
                                @ (w[g].float() * s_w[g][:, None]).T)
        start += c
    torch.cuda.synchronize()
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"unpadded groups (5, 0, 16, 21, 3 rows): rel err {err:.2e} against f32")
    return 0 if err < 1e-2 else 1


def describe(runner: "PeerRunner | None" = None) -> str:
    """One line naming the peer's library version and settings (for the table's header)."""
    import torch
    text = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
            "torch._scaled_grouped_mm FP8 rowwise")
    if runner is not None:
        what = ("GEMMs + SwiGLU + FP8 quantisation between them (torch ops, timed)"
                if runner.glue else "the two GEMMs only")
        pad = ("groups unpadded" if runner.align == 1
               else f"groups padded to multiples of {runner.align} rows")
        text += (f", {what}, {pad}, "
                 f"{'fast' if runner.fast_accum else 'precise'} accumulation")
    return text


def is_oom(err: Exception) -> bool:
    """Whether ``err`` is torch's device running out of memory."""
    return type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower()


def empty_cache():
    """Hand torch's cached device blocks back."""
    import torch
    torch.cuda.empty_cache()


class PeerRunner:
    """FP8 expert weights of one shape on the torch device, input sets, the peer call and its
    timing. ``dims``: ``(experts, dim, moe_inter_dim, k)`` (``cases.MoeDims``)."""

    def __init__(self, dims, *, align: int = ALIGN, glue: bool = False,
                 swiglu_limit: float = 0.0, fast_accum: bool = True, seed: int = 0):
        import torch
        self.experts, self.dim, self.inter = int(dims[0]), int(dims[1]), int(dims[2])
        self.align, self.glue, self.limit = align, glue, float(swiglu_limit)
        self.fast_accum = fast_accum
        self.device = torch.device("cuda")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        e, d, inter = self.experts, self.dim, self.inter
        self.w13 = self._fp8_weight(gen, e, 2 * inter, d)         # [E, 2 inter, d]
        self.w2 = self._fp8_weight(gen, e, d, inter)              # [E, d, inter]
        # rowwise scales ~ K^-1/2 keep the outputs O(1)
        self.s_w13 = (torch.rand(e, 2 * inter, generator=gen, device=self.device) + 0.5
                      ) * d ** -0.5
        self.s_w2 = (torch.rand(e, d, generator=gen, device=self.device) + 0.5) * inter ** -0.5
        self._gen = gen

    def _fp8_weight(self, gen, groups, out_f, in_f):
        import torch
        w = torch.empty(groups, out_f, in_f, dtype=torch.float8_e4m3fn, device=self.device)
        for g in range(groups):                # one group at a time: no large temporaries
            w[g].copy_(torch.randn(out_f, in_f, generator=gen, device=self.device,
                                   dtype=torch.bfloat16))
        return w

    def inputs(self, counts) -> dict:
        """One input set for ``counts`` real rows per expert: FP8 rows with rowwise scales
        (padding rows zero), the routing weight per row (zero on padding), ``offs``."""
        import torch
        counts = np.asarray(counts, np.int64)
        if counts.shape != (self.experts,):
            raise ValueError(f"inputs: counts must have shape ({self.experts},), got "
                             f"{counts.shape}")
        offs, _ = padded_offsets(counts, self.align)
        real = torch.from_numpy(real_rows_mask(counts, self.align)).to(self.device)
        m = int(offs[-1])
        keep = real[:, None].to(torch.bfloat16)

        def rows(width):
            x = torch.randn(m, width, generator=self._gen, device=self.device,
                            dtype=torch.bfloat16) * keep
            return x.to(torch.float8_e4m3fn)

        def scales():
            return torch.rand(m, generator=self._gen, device=self.device) + 0.5

        rw = torch.rand(m, generator=self._gen, device=self.device) * real
        return dict(a1=rows(self.dim), s_a1=scales(), a2=rows(self.inter), s_a2=scales(),
                    rw=rw, offs=torch.from_numpy(offs).to(self.device),
                    rows=m, real_rows=int(counts.sum()))

    def gemm(self, a, w, s_a, s_w, offs):
        """One grouped GEMM: ``a`` [M, K] FP8 row-major against ``w`` [G, N, K] contiguous,
        passed as its column-major transpose [G, K, N] -> [M, N] bf16."""
        import torch
        return torch._scaled_grouped_mm(a, w.transpose(-2, -1), s_a, s_w, offs=offs,
                                        out_dtype=torch.bfloat16,
                                        use_fast_accum=self.fast_accum)

    def glue_rows(self, out1, rw):
        """SwiGLU (DSV4's clamp) x routing weight on the gated GEMM's output, then the rowwise
        FP8 quantisation of the w2 GEMM's input: ``(a2 [M, inter] FP8, s_a2 [M] f32)``."""
        import torch
        h = out1.float()
        g, u = h[:, :self.inter], h[:, self.inter:]
        if self.limit > 0:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        h = torch.nn.functional.silu(g) * u * rw[:, None]
        scale = h.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        return (h / scale[:, None]).to(torch.float8_e4m3fn), scale

    def __call__(self, inp: dict):
        """One peer call: ``(out1 [M, 2 inter], out2 [M, d])`` bf16."""
        out1 = self.gemm(inp["a1"], self.w13, inp["s_a1"], self.s_w13, inp["offs"])
        a2, s_a2 = (self.glue_rows(out1, inp["rw"]) if self.glue
                    else (inp["a2"], inp["s_a2"]))
        return out1, self.gemm(a2, self.w2, s_a2, self.s_w2, inp["offs"])

    def seconds(self, sets: list, runs: int = 20, warmup: int = 2) -> float:
        """Median time of one call over ``runs`` executions of ``len(sets)`` back-to-back
        calls on distinct sets (CUDA events; module docstring)."""
        import torch
        for _ in range(warmup):
            for s in sets:
                self(s)
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start.record()
            for s in sets:
                self(s)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)       # ms -> s
        return statistics.median(times) / len(sets)

    def release(self):
        """Drop the weights and hand torch's cached blocks back (the next shape's turn)."""
        import torch
        self.w13 = self.w2 = self.s_w13 = self.s_w2 = None
        torch.cuda.empty_cache()


def time_peer(runner: PeerRunner, counts_per_set, runs: int) -> dict:
    """Time ``runner`` on one input set per entry of ``counts_per_set``: ``{"seconds",
    "rows" (executed, mean per set), "real_rows" (mean)}``; ``seconds`` is ``"oom"`` where the
    device ran out of memory."""
    import torch
    sets = []
    try:
        sets = [runner.inputs(c) for c in counts_per_set]
        seconds = runner.seconds(sets, runs=runs)
    except Exception as err:
        if not is_oom(err):
            raise
        seconds = "oom"
    rows = float(np.mean([padded_offsets(c, runner.align)[0][-1] for c in counts_per_set]))
    real = float(np.mean([np.sum(c) for c in counts_per_set]))
    del sets
    torch.cuda.empty_cache()
    return dict(seconds=seconds, rows=rows, real_rows=real)


if __name__ == "__main__" and sys.argv[1:] == ["--probe-unpadded"]:
    sys.exit(_probe_unpadded_child())
