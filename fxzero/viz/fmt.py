"""Human-readable numbers for the CLI's tables and labels."""

from __future__ import annotations

__all__ = ["human_bytes", "human_count", "human_seconds"]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, three significant digits)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    """124439808 -> '124M'; 6738415616 -> '6.74B'."""
    n = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_seconds(s: float) -> str:
    """0.00123 -> '1.23 ms'."""
    if s == 0:
        return "0"
    if abs(s) >= 100:
        return f"{s:,.0f} s"
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
