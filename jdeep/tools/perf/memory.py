"""Process memory readings (Linux /proc/self/status), for benchmarks and memory tests."""

from __future__ import annotations

__all__ = ["status_bytes"]


def status_bytes(field: str) -> int:
    """A kB field of /proc/self/status in bytes: VmRSS (resident), VmHWM (peak resident), RssFile
    (resident file-backed pages, e.g. memory-mapped tables), RssAnon, ..."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no field {field!r}")
