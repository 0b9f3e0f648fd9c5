"""What the one-op benchmarks with kernel-config columns share (``bench_hc_pre.py``,
``bench_router.py``, ``bench_hc_mixes.py``): their common flags, the columns they time, the
report's head, and one cell's figures."""
from __future__ import annotations

import argparse
import datetime
import sys

import jax

from step_figures import trace_device_ops
from timing import median_seconds


def parser(doc: str, tokens: str) -> argparse.ArgumentParser:
    """The flags every such benchmark takes (``--dims``, ``--tokens`` defaulting to
    ``tokens``, ``--impls``, ``--configs``, ``--runs``, ``--tiny``, ``--markdown``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--dims", default="flash,pro")
    p.add_argument("--tokens", default=tokens)
    p.add_argument("--impls", default="xla,cute")
    p.add_argument("--configs", default="", help="kernel configs CxTB, a column each")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--markdown")
    return p


def table_head(script: str, leading: list[str], impls: list[str]) -> list[str]:
    """The report's first lines: ``script``, the date, the device and the command's flags,
    then the table header -- the ``leading`` columns, a "wall / device us (launches)" column
    per timed implementation, the byte floor."""
    return [f"{script} {datetime.date.today()} {jax.devices()[0].device_kind}: "
            f"{' '.join(sys.argv[1:])}", "",
            "| " + " | ".join(leading) + " | "
            + " | ".join(f"{i}: wall / device us (launches)" for i in impls)
            + " | byte floor (us) |",
            "|" + "---|" * (len(leading) + len(impls) + 1)]


def columns(args) -> list[str]:
    """The timed columns: the implementations, then the kernel configs (``--tiny``: only
    the reference, which runs on a CPU)."""
    if args.tiny:
        return ["xla"]
    return args.impls.split(",") + [c for c in args.configs.split(",") if c]


def cell(make_fn, inputs, runs: int) -> str:
    """``"wall / device us (launches)"`` of ``make_fn()(*inputs)``: the median wall time of
    waited calls and the device ops of one traced call; a failure (a config the kernel
    refuses included) is reported in the cell."""
    try:
        fn = make_fn()
        wall = median_seconds(fn, *inputs, runs=runs) * 1e6
        totals, counts = trace_device_ops(lambda: jax.block_until_ready(fn(*inputs)))
        return f"{wall:.1f} / {sum(totals.values()):.1f} ({sum(counts.values())})"
    except Exception as err:  # noqa: BLE001 -- a row's failure is reported in it
        return f"error: {type(err).__name__}: {str(err)[:80]}"
