"""A process's own peak memory (``devices.peak_resident``): what the local calibration's
reserve and the benches' peaks are read as."""

from __future__ import annotations

import subprocess
import sys

from fxmeg.diagnostics.devices import peak_resident

CHILD = ("import resource; from fxmeg.diagnostics.devices import peak_resident; "
         "print(peak_resident(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def test_a_child_reads_its_own_peak_not_its_larger_parents():
    """Across exec Linux keeps the larger of the old and the new address space's peaks in
    ``ru_maxrss``: a process that a large one starts reports the parent's peak (a rank of
    the local calibration, started from a process holding a captured model). VmHWM is the
    child's own."""
    big = bytearray(400 * 2**20)
    big[:: 4096] = b"\1" * len(big[:: 4096])  # resident
    assert peak_resident() >= 400 * 2**20
    own, rusage = map(int, subprocess.run([sys.executable, "-c", CHILD], check=True,
                                          capture_output=True, text=True).stdout.split())
    assert rusage >= 400 * 2**20 > own  # the child holds far less than the parent did
    del big
