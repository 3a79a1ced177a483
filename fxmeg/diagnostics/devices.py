"""Accelerators' memory by name, sizes as a user writes them (`fxmeg plan
--device-memory 80GB`, `h100`), and a process's own peak host memory."""

from __future__ import annotations

import re
import resource

from fxmeg.errors import ConfigError

GiB = 2**30
DEVICES = {  # usable memory as nvidia-smi reports it (MiB)
    "h100": 81559 * 2**20,
    "h200": 143771 * 2**20,
    "a100-40gb": 40960 * 2**20,
    "a100-80gb": 81920 * 2**20,
}
"""--device-memory presets: an accelerator's memory as nvidia-smi reports it."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def device_bytes(text: str) -> int:
    """Bytes of '80GB' (10^9), '80GiB' / '79.6GiB' (2^30), or a preset of ``DEVICES``."""
    key = text.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?", key)
    if not match:
        raise ConfigError(
            f"--device-memory {text!r} is neither a size (80GB, 80GiB, 79.6GiB) nor a device "
            f"({', '.join(DEVICES)})"
        )
    return int(float(match[1]) * _UNITS[match[2] or ""])


def peak_resident() -> int:
    """Bytes of this process's peak resident set: Linux's ``VmHWM``, the high-water mark of
    its own address space. Not ``ru_maxrss``: across exec Linux keeps the larger of the old
    and the new address space's peaks, so a process that ``torch.multiprocessing.spawn``
    started reports its parent's peak when that was larger (a search's parent holding the
    captured model: measured 818 MiB for a child whose own peak was 218)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc: the rusage figure (KiB on Linux)
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
