"""The largest buffers of XLA-compiled programs, from an ``--xla_dump_to`` folder: what the
temporaries of a program are (``memory_analysis`` gives only their total).

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=jit__lambda" python prog.py
    python benchmarks/largest_buffers.py /tmp/dump [--top 15]

Reads each ``*buffer-assignment.txt`` (the values XLA assigned to allocations) and prints the
``--top`` largest values per program: size, HLO value name, shape and the JAX op path that
made it (the ``op_name`` metadata of the instruction in the optimised HLO).
"""
from __future__ import annotations

import argparse
import glob
import os
import re

VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)")


def largest(path: str, top: int) -> list:
    seen = {}
    with open(path) as f:
        for line in f:
            m = VALUE.search(line)
            if m:
                name, size, shape = m.group(1), int(m.group(2)), m.group(3).strip()
                seen[name] = (size, name, shape)
    return sorted(seen.values(), reverse=True)[:top]


def op_names(path: str) -> dict:
    """HLO instruction name -> its ``op_name`` metadata, from the optimised HLO text beside
    a buffer assignment."""
    hlo = path.replace("-buffer-assignment.txt", ".txt")
    names = {}
    if os.path.exists(hlo):
        with open(hlo) as f:
            for line in f:
                m = re.match(r"\s*(?:ROOT )?%?(\S+) = .*op_name=\"([^\"]*)\"", line)
                if m:
                    names[m.group(1)] = m.group(2)
    return names


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    for path in sorted(glob.glob(os.path.join(args.folder, "*buffer-assignment.txt"))):
        print(f"## {os.path.basename(path)}")
        names = op_names(path)
        for size, name, shape in largest(path, args.top):
            print(f"{size / 2 ** 20:10.1f} MiB  {name}  {shape[:80]}  {names.get(name, '')[-160:]}")


if __name__ == "__main__":
    main()
