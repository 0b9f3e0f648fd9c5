"""``benchmarks/critical_path.py`` without a GPU: the longest chain of a loop body's launches
when independent ones run at once, and ``trace_device_ops``' per-HLO-op times it reads."""
import collections
import os
import sys

import jax
import jax.numpy as jnp
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import critical_path  # noqa: E402
import step_figures  # noqa: E402

_LAYER = 'metadata={op_name="jit(loop)/while/body/DSV4/layers_0/layers_0.block/attn/%s/mul"}'
# A loop body of four launches: q and kv independent, o after both, h after kv.
HLO = f"""HloModule jit_loop

%body.1 (p.1: (f32[], f32[])) -> (f32[], f32[]) {{
  %p.1 = (f32[], f32[]) parameter(0)
  %a = f32[] get-tuple-element(%p.1), index=0
  %q = f32[] fusion(%a), kind=kLoop, calls=%fq, {_LAYER % "q"}
  %kv = f32[] fusion(%a), kind=kLoop, calls=%fkv, {_LAYER % "kv"}
  %o = f32[] fusion(%q, %kv), kind=kLoop, calls=%fo, {_LAYER % "o"}
  %h = f32[] custom-call(%kv), custom_call_target="ffi", {_LAYER % "h"}
  ROOT %t = (f32[], f32[]) tuple(%o, %h)
}}

ENTRY %main.2 (x: (f32[], f32[])) -> (f32[], f32[]) {{
  %x = (f32[], f32[]) parameter(0)
  ROOT %w = (f32[], f32[]) while(%x), condition=%cond.1, body=%body.1
}}
"""


def test_the_longest_chain_of_concurrent_launches():
    instrs = critical_path.instructions(critical_path.loop_body(HLO))
    assert [name for name, _, launches, _ in instrs if launches] == ["q", "kv", "o", "h"]
    us = {"q": 5.0, "kv": 8.0, "o": 2.0, "h": 1.0}
    length, path = critical_path.critical_path(instrs, us, 0.0)
    assert length == 10.0 and [n for n in path if n in us] == ["kv", "o"]
    length, path = critical_path.critical_path(instrs, {**us, "h": 4.0}, 1.0)
    assert length == 14.0 and [n for n in path if n in us] == ["kv", "h"]
    text = critical_path.report(instrs, us, 1.0, 5)
    assert text.startswith("critical path 12 us over 2 launches")
    assert "| `layers_*/attn/kv` | 9.0 | 1 |" in text


def test_what_if_scales_or_removes_matching_launches():
    """A rule scales the launches it matches (by HLO name or op name); factor 0 removes them
    with their launch latency, and the path moves to the chain that is left."""
    instrs = critical_path.instructions(critical_path.loop_body(HLO))
    us = {"q": 5.0, "kv": 8.0, "o": 2.0, "h": 1.0}
    scaled, removed = critical_path.what_if(instrs, us, critical_path.parse_rules(
        "attn/kv/=0.5;^o =0"))
    assert scaled == {"q": 5.0, "kv": 4.0, "o": 0.0, "h": 1.0} and removed == {"o"}
    length, path = critical_path.critical_path(instrs, scaled, 1.0, removed)
    assert length == 7.0 and [n for n in path if n in us and n not in removed] == ["kv", "h"]
    with pytest.raises(ValueError, match="REGEX=FACTOR"):
        critical_path.parse_rules("attn")


def test_what_ifs_report_each_scenario_against_the_base():
    instrs = critical_path.instructions(critical_path.loop_body(HLO))
    text = critical_path.what_ifs(instrs, {"q": 5.0, "kv": 8.0, "o": 2.0, "h": 1.0}, 1.0,
                                  [("no o", "^o =0"), ("faster kv", "attn/kv/=0.5")])
    assert text.splitlines() == ["what if no o: 11 us (-8.3%; 1 launches removed)",
                                 "what if faster kv: 9 us (-25.0%; 0 launches removed)"]
    for _, rules in critical_path.STANDARD_WHAT_IFS:
        assert critical_path.parse_rules(rules)


def test_chain_lists_the_paths_launches_in_order():
    instrs = critical_path.instructions(critical_path.loop_body(HLO))
    lines = critical_path.chain(instrs, {"q": 5.0, "kv": 8.0, "o": 2.0, "h": 1.0},
                                1.0).splitlines()
    assert [line.split()[:2] for line in lines] == [["8.0", "kv"], ["2.0", "o"]]
    assert lines[0].endswith("layers_0/layers_0.block/attn/kv/mul")


def test_a_profile_of_command_buffers_is_flagged():
    """Op times that the profiler gave a command buffer, not its ops, leave every launch at
    0 us: the report says so first."""
    instrs = critical_path.instructions(critical_path.loop_body(HLO))
    text = critical_path.report(instrs, {"command_buffer_10": 16.0}, 1.0, 5)
    assert text.startswith("warning: the profile timed command buffers (command_buffer_10)")


def test_an_hlo_without_a_loop_is_refused():
    with pytest.raises(ValueError, match="no while loop"):
        critical_path.loop_body("HloModule m\n")


def test_trace_device_ops_times_each_hlo_op():
    """On the CPU backend the host threads' ops carry their HLO op: times and launch counts
    per op, which add up to the traced ops' total."""
    fn = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64), jnp.float32)
    by_op, op_launches = collections.Counter(), collections.Counter()
    totals, _ = step_figures.trace_device_ops(lambda: jax.block_until_ready(fn(x)),
                                              by_op=by_op, op_launches=op_launches)
    assert by_op and set(op_launches) == set(by_op)
    assert all(op_launches[op] >= 1 for op in by_op)
    assert abs(sum(by_op.values()) - sum(totals.values())) < 1e-6
