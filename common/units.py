"""Sizes for people: bytes as B / KiB / MiB / GiB (base 1024, memory) or B / KB / MB / GB (base 1000, disks)."""

from __future__ import annotations


def human_bytes(n: float, base: int = 1024) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB") if base == 1024 else ("B", "KB", "MB", "GB", "TB")
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable: the last unit always returns")
