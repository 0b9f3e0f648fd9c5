"""``benchmarks/loop_instruction_mix.py`` without a GPU: the K loop's body found in PTX (the
longest backward branch, inline assembly included, labels and declarations not counted)
and its opcodes, on a synthetic kernel; then the routed launches compiled for sm_90a."""
import collections
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

pytest.importorskip("cutlass")
import loop_instruction_mix as mix  # noqa: E402

PTX = """
.entry k() {
	.reg .b32 %r<9>;
	mov.b32 	%r1, 0;
$L__BB0_1:
	add.s32 	%r1, %r1, 1;
$L__BB0_2:
	.pragma "nounroll";
	ld.shared.u32 	%r2, [%r3];
	{
	.reg .b32 lo;
	shl.b32 lo, %r2, 16;
	and.b32 %r4, lo, 0x7FFFFFFF;
	}
	// a comment
	setp.lt.s32 	%p1, %r1, 8;
	@%p1 bra 	$L__BB0_2;
	@%p1 bra 	$L__BB0_1;
	ret;
}
"""


def test_the_longest_backward_branch_is_the_loop():
    body = mix.loop_body(PTX)
    assert collections.Counter(map(mix.opcode, body)) == {
        "add": 1, "ld": 1, "shl": 1, "and": 1, "setp": 1, "bra": 2}


def test_kernel_instructions_count_the_entry_body():
    assert mix.kernel_instructions(PTX) == 9         # mov, add, ld, shl, and, setp, 2 bra, ret


@pytest.mark.parametrize("registers, smem, want", [
    (62, 20 * 1024, dict(resident=8, registers=8, warps=16)),   # the routed w2 at T = 8
    (77, 32 * 1024, dict(resident=6, registers=6, warps=16)),   # ... on two row blocks
    (40, 100 * 1024, dict(resident=2, registers=12, warps=16))])
def test_resident_ctas_take_the_tightest_limit(registers, smem, want):
    ctas = mix.resident_ctas(registers, smem)
    assert {k: ctas[k] for k in want} == want
    assert ctas["resident"] == min(ctas["registers"], ctas["shared memory"], ctas["warps"])


def test_routed_launches_have_a_k_loop(capsys):
    sys.argv = ["loop_instruction_mix.py", "--tokens", "8"]
    mix.main()
    out = capsys.readouterr().out.splitlines()
    lines = [l for l in out if "per warp and K block" in l]
    assert [l.split(":")[0] for l in lines] == ["w1/w3", "w2"]
    # Each launch: its code outside the loop, and its residency where ptxas is present.
    extra = [l for l in out if l.strip().startswith("outside the loop")]
    assert len(extra) == 2
    for l in extra:
        assert 0 < int(l.split()[3]) < 5000
        assert "resident CTAs per SM" in l or "registers not counted" in l
    counts = [int(l.split("token codes ")[1].split(": ")[1].split()[0]) for l in lines]
    assert all(100 < c < 2000 for c in counts)       # a K block's conversion and MMAs, once
