"""Sizes for people: counts with K/M/B and bytes with KiB/MiB/GiB picked by magnitude.

Output that prints every size in one fixed unit reads "0.0B params" for a 9.3M-parameter model
or "0.0 GiB" for 40 MiB; these pick the unit that fits, one decimal (no imports beyond the
standard library: ``genolong plan`` and ``prepare`` use them without torch).
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_count"]

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = ("K", "M", "B", "T")


def format_bytes(nbytes: float, zero: str = "0 B") -> str:
    """``nbytes`` in the largest binary unit that keeps the value at least 1, one decimal.

    ``512`` -> ``"512 B"``, ``40 * 2**20`` -> ``"40.0 MiB"``, ``180 * 2**30`` -> ``"180.0 GiB"``;
    ``zero`` for 0 (a table may prefer ``"0"``).
    """
    if nbytes == 0:
        return zero
    size, unit = float(nbytes), "B"
    if abs(round(size)) < 1024:
        return f"{size:,.0f} B"
    for unit in _BYTE_UNITS:  # noqa: B007 - the unit the loop stops at is the one printed
        size /= 1024
        if abs(round(size, 1)) < 1024:  # as printed: 1023.96 MiB is "1.0 GiB", not "1,024.0 MiB"
            break
    return f"{size:,.1f} {unit}"


def format_count(n: float) -> str:
    """``n`` with the largest decimal suffix that keeps the value at least 1, one decimal.

    ``950`` -> ``"950"``, ``9_300_000`` -> ``"9.3M"``, ``7.2e9`` -> ``"7.2B"`` (B: billion, as in
    "7B params").
    """
    value, unit = float(n), ""
    if abs(round(value)) < 1000:
        return f"{value:,.0f}"
    for unit in _COUNT_UNITS:  # noqa: B007 - the unit the loop stops at is the one printed
        value /= 1000
        if abs(round(value, 1)) < 1000:  # as printed: 999,960 is "1.0M", not "1,000.0K"
            break
    return f"{value:,.1f}{unit}"
