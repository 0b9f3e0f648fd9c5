"""The limits of the MoE schedule kernel (``moe_schedule_sm90``), importable without cutlass."""
from __future__ import annotations

__all__ = ["THREADS", "MAX_ROWS", "supports"]

THREADS = 1024      # one CTA; thread g owns group g, and one more holds the dropped rows
# Each row counts the rows before it in its group: a loop of up to MAX_ROWS keys, short next
# to a launch at decode (batch 64 of Flash: 384 rows); larger row counts sort in XLA.
MAX_ROWS = 512


def supports(rows: int, groups: int) -> tuple[bool, str]:
    """Whether the kernel schedules ``rows`` rows over ``groups`` groups: ``(ok, reason)``."""
    if not 0 < rows <= MAX_ROWS:
        return False, f"{rows} rows: the schedule kernel takes 1 to {MAX_ROWS}"
    if not 0 < groups < THREADS:
        return False, f"{groups} groups: the schedule kernel takes 1 to {THREADS - 1}"
    return True, ""
