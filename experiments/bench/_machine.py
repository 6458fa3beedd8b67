"""What a benchmark prints about the machine it ran on (shared by the bench scripts)."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    """``lscpu``'s model name where /proc/cpuinfo has one, else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
