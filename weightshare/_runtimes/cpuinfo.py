"""The CPU's ISA flags, as /proc/cpuinfo lists them: what ORT's MLAS and XNNPACK dispatch on."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    """Union of the ``flags`` (x86) / ``Features`` (Arm) lines of every core; empty where /proc/cpuinfo is absent."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    return flags
