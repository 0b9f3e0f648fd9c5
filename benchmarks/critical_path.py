"""The critical path of a decode step whose launches run concurrently (no GPU needed).

With concurrent commands (``dsv4_jax/_xla_flags.py``) a step's launches overlap wherever
their buffers allow, so the step takes about its longest dependency chain, not the sum of its
launches -- and the profiler, which sees kernels only outside CUDA graphs, cannot show that
chain. This tool rebuilds it: the dependency graph of the while loop's body from XLA's
optimised HLO (every instruction's operands), each launch weighted by its measured time (a
profile of the same program without command buffers, per HLO op) plus a fixed
launch latency, and the longest path through it.

    python3 critical_path.py HLO_AFTER_OPTIMIZATIONS.txt OPS.tsv [--launch-us 1.0] [--top 25]
        [--what-if 'REGEX=FACTOR[;REGEX=FACTOR...]' ...] [--chain]

``--what-if``: the path again with the launches whose "HLO name op_name" matches a REGEX
taking FACTOR times their time (0: the launch is gone, its latency too) -- a fusion or a
faster kernel priced before it is built. Each ``--what-if`` is one scenario; its rules
(separated by ``;``) apply together; ``--what-if standard``: the candidates of
``STANDARD_WHAT_IFS``. ``--chain``: the path's launches in order, with their
times and op names.

``OPS.tsv``: ``hlo_op<TAB>us_per_step<TAB>launches_per_step`` (``decode_step.py --out F``
writes it as ``F_hloops_b<batch>.tsv`` for the attributed batches; the HLO comes from
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``: the ``jit_loop`` module's
``*after_optimizations.txt``). docs/performance.md, "Concurrent commands", has the method's
check against a measured step.
"""
from __future__ import annotations

import argparse
import collections
import re

from step_figures import module_of

_WHILE = re.compile(r"while\([^)]*\), condition=%[\w.\-]+, body=%([\w.\-]+)")
_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Instructions that launch nothing: they name, slice or regroup buffers.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def loop_body(hlo_text: str) -> list[str]:
    """The lines of the first while loop's body computation."""
    match = _WHILE.search(hlo_text)
    if not match:
        raise ValueError("critical_path: the HLO has no while loop")
    lines = hlo_text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"%{match.group(1)} "))
    end = next(i for i in range(head + 1, len(lines)) if lines[i].strip() == "}")
    return lines[head + 1:end]


def instructions(lines: list[str]) -> list[tuple[str, list[str], bool, str]]:
    """``(name, operands, launches, op_name)`` of each instruction, in program order
    (operands: the instruction names before its attributes; a fusion's ``calls=`` and a
    custom call's metadata are not operands)."""
    out = []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, _, kind, rest = match.groups()
        args = rest.split("), ")[0].split(", kind=")[0]
        op_name = _OP_NAME.search(line)
        out.append((name, _OPERAND.findall(args), kind not in _FREE,
                    op_name.group(1) if op_name else ""))
    return out


def critical_path(instrs, us_by_op: dict, launch_us: float,
                  removed=frozenset()) -> tuple[float, list[str]]:
    """Length (us) and instructions of the longest chain: each launching instruction weighs
    its ``us_by_op`` time (0 if absent) plus ``launch_us``, unless it is ``removed``; the
    others weigh nothing."""
    finish, before = {}, {}
    for name, operands, launches, _ in instrs:
        ready = [(finish[o], o) for o in operands if o in finish]
        start, parent = max(ready) if ready else (0.0, None)
        weight = (us_by_op.get(name, 0.0) + launch_us
                  if launches and name not in removed else 0.0)
        finish[name], before[name] = start + weight, parent
    if not finish:
        return 0.0, []
    node = max(finish, key=finish.get)
    length, path = finish[node], []
    while node is not None:
        path.append(node)
        node = before[node]
    return length, path[::-1]


def chain(instrs, us_by_op: dict, launch_us: float) -> str:
    """The critical path's launches in order: us, HLO name and op name (the loop prefix
    dropped), one per line -- a layer's chain read top to bottom."""
    _, path = critical_path(instrs, us_by_op, launch_us)
    info = {name: (launches, op_name) for name, _, launches, op_name in instrs}
    lines = []
    for name in path:
        launches, op_name = info[name]
        if launches:
            short = re.sub(r"^jit\(loop\)/while/body/(DSV4/)?", "", op_name)
            short = re.sub(r"/cond/branch_\d+_fun/.*", " (call)", short)
            lines.append(f"{us_by_op.get(name, 0.0):8.1f}  {name:36s} {short[:100]}")
    return "\n".join(lines)


def what_if(instrs, us_by_op: dict, rules) -> tuple[dict, frozenset]:
    """``(us_by_op, removed)`` after ``rules`` -- ``(regex, factor)`` pairs: a launching
    instruction whose ``"name op_name"`` matches a regex takes ``factor`` times its time
    (the first matching rule), and with factor 0 it is removed (no launch latency)."""
    scaled, removed = dict(us_by_op), set()
    for name, _, launches, op_name in instrs:
        rule = next((f for r, f in rules if re.search(r, f"{name} {op_name}")), None)
        if not launches or rule is None:
            continue
        scaled[name] = us_by_op.get(name, 0.0) * rule
        if rule == 0:
            removed.add(name)
    return scaled, frozenset(removed)


# The candidates priced in docs/performance.md ("the step's critical path, measured"), by the
# op names the model's modules give their launches: ``--what-if standard`` runs them all.
STANDARD_WHAT_IFS = (
    ("the routed launches at their HBM floor (x 0.49)",
     r"ffn/cond/branch_0_fun/jit\(call_wrapper\)=0.49"),
    ("the query path's XLA launches and the FFN sum gone",
     r"attn/q_norm/=0;attn/reduce_sum=0;attn/concatenate=0;attn/mul=0;"
     r"ffn/convert_element_type=0;indexer/(concatenate|dot_general|reduce_max|"
     r"convert_element_type)=0"),
    ("wo_a and wo_b at 0.6 x (one launch at their joint floor)", "attn/wo_a/=0.6;attn/wo_b/=0.6"),
    ("the mHC pre at half its time", "_mhc_pre/=0.5"),
    ("the heads' norm, RoPE and inverse RoPE inside the attention kernel",
     "attn/reduce_sum=0;attn/concatenate=0;attn/mul=0"),
    ("the router at half its time", "ffn/gate/=0.5"),
    ("q_norm inside wq_b", "attn/q_norm/=0"),
    ("the indexer's query glue gone",
     "indexer/(concatenate|dot_general|reduce_max|convert_element_type)=0"),
    ("the FFN sum inside the next mHC pre", "ffn/convert_element_type=0"),
)


def what_ifs(instrs, us_by_op: dict, launch_us: float, scenarios) -> str:
    """One line per ``(label, rules)`` scenario: its path and the change from the base."""
    base, _ = critical_path(instrs, us_by_op, launch_us)
    lines = []
    for label, text in scenarios:
        scaled, removed = what_if(instrs, us_by_op, parse_rules(text))
        length, _ = critical_path(instrs, scaled, launch_us, removed)
        lines.append(f"what if {label}: {length:.0f} us ({length / base - 1:+.1%}; "
                     f"{len(removed)} launches removed)")
    return "\n".join(lines)


def parse_rules(text: str) -> list[tuple[str, float]]:
    """``'REGEX=FACTOR;REGEX=FACTOR'`` -> ``[(regex, factor), ...]`` (the last ``=`` splits)."""
    rules = []
    for part in filter(None, text.split(";")):
        regex, sep, factor = part.rpartition("=")
        if not sep or not regex:
            raise ValueError(f"critical_path: a what-if rule is REGEX=FACTOR, got {part!r}")
        rules.append((regex, float(factor)))
    return rules


def read_ops(path: str) -> dict:
    """``{hlo_op: us per step}`` of an ``OPS.tsv`` (see the module docstring)."""
    out = {}
    with open(path) as f:
        next(f)
        for line in f:
            op, us, _ = line.rstrip("\n").split("\t")[:3]
            out[op] = float(us)
    return out


def report(instrs, us_by_op: dict, launch_us: float, top: int) -> str:
    """The critical path's length, launches and time by module (markdown)."""
    length, path = critical_path(instrs, us_by_op, launch_us)
    info = {name: (launches, op_name) for name, _, launches, op_name in instrs}
    on_path = [name for name in path if info[name][0]]
    by, count = collections.Counter(), collections.Counter()
    for name in on_path:
        label = module_of(info[name][1])
        by[label] += us_by_op.get(name, 0.0) + launch_us
        count[label] += 1
    total = sum(us_by_op.get(name, 0.0) for name, _, launches, _ in instrs if launches)
    lines = [f"critical path {length:.0f} us over {len(on_path)} launches (launch latency "
             f"{launch_us} us each); all launches {total:.0f} us", "",
             "| module | us on the path | launches |", "|---|---|---|"]
    buffers = sorted(op for op in us_by_op if op.startswith("command_buffer"))
    if buffers:
        # Inside a command buffer the profiler names only the buffer: no op has a time.
        lines.insert(0, f"warning: the profile timed command buffers ({', '.join(buffers)}), "
                        f"not their ops: profile without command buffers "
                        f"(--xla_gpu_enable_command_buffer=; decode_on_device.sh generate)")
    lines += [f"| `{label}` | {us:.1f} | {count[label]} |" for label, us in by.most_common(top)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", help="XLA's optimised HLO text of the loop's module")
    p.add_argument("ops", help="TSV of us per step by HLO op")
    p.add_argument("--launch-us", type=float, default=1.0,
                   help="latency added to every launch on the path")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--what-if", action="append", default=[], metavar="REGEX=FACTOR[;...]",
                   help="a scenario: matching launches' times scaled (0: removed)")
    p.add_argument("--chain", action="store_true", help="list the path's launches in order")
    args = p.parse_args(argv)
    with open(args.hlo) as f:
        instrs = instructions(loop_body(f.read()))
    us = read_ops(args.ops)
    print(report(instrs, us, args.launch_us, args.top))
    if args.chain:
        print(chain(instrs, us, args.launch_us))
    scenarios = [s for text in args.what_if
                 for s in (STANDARD_WHAT_IFS if text == "standard" else [(text, text)])]
    if scenarios:
        print(what_ifs(instrs, us, args.launch_us, scenarios))


if __name__ == "__main__":
    main()
