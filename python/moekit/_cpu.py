"""The instruction-set check run before the native module loads: a module built for a CPU level
this machine lacks would die on its first vector instruction (SIGILL); this raises instead."""
from __future__ import annotations

import platform

# -march levels the wheel may be built for -> the /proc/cpuinfo flags each needs.
_LEVEL_FLAGS = {
    "x86-64-v2": ("sse4_2", "popcnt", "ssse3"),
    "x86-64-v3": ("sse4_2", "popcnt", "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"),
    "x86-64-v4": ("avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def missing_flags(level: str, cpuinfo: str = "/proc/cpuinfo") -> list:
    """The CPU flags `level` needs that this machine does not report (none where unknown)."""
    need = _LEVEL_FLAGS.get(level)
    if not need or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in need if x not in have]
    except OSError:
        pass
    return []


def check(level: str) -> None:
    missing = missing_flags(level)
    if missing:
        raise ImportError(f"moekit: this build's CPU code needs {level} (MOEKIT_CPU_ARCH), and this CPU lacks "
                          f"{', '.join(missing)}; rebuild from source here: pip install . "
                          f"--config-settings=cmake.define.MOEKIT_CPU_ARCH=native")
