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


def test_routed_launches_have_a_k_loop(capsys):
    sys.argv = ["loop_instruction_mix.py", "--tokens", "8"]
    mix.main()
    lines = [l for l in capsys.readouterr().out.splitlines() if "per warp and K block" in l]
    assert [l.split(":")[0] for l in lines] == ["w1/w3", "w2"]
    counts = [int(l.split("token codes ")[1].split(": ")[1].split()[0]) for l in lines]
    assert all(100 < c < 2000 for c in counts)       # a K block's conversion and MMAs, once
