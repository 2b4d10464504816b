"""Which CUDA backend fa_numba runs on: a real GPU, or Numba's CUDA simulator.

The simulator must be chosen before numba.cuda is first imported, so `select()` runs when fa_numba is
imported: if NUMBA_ENABLE_CUDASIM is unset and no NVIDIA driver is visible on this machine, it sets
NUMBA_ENABLE_CUDASIM=1 so `import fa_numba` works on a laptop. Set NUMBA_ENABLE_CUDASIM=0 or 1 yourself to
choose. FA_NUMBA_SIM=1 forces the simulator even where a GPU is present.
"""

from __future__ import annotations

import os
import shutil
import sys


def gpu_driver_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def select() -> str:
    if "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba.cuda" not in sys.modules:
        if os.environ.get("FA_NUMBA_SIM") == "1" or not gpu_driver_visible():
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return name()


def name() -> str:
    """'simulator' or 'gpu' (what numba.cuda will use or uses)."""
    return "simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "gpu"
