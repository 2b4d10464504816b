"""Test configuration: CUDA simulator without a GPU, Hypothesis profiles.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, so this runs at collection start.
With a GPU present (and FA_NUMBA_SIM unset) the same tests run on the device.
"""

import os
import shutil
import sys

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    has_gpu = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    if os.environ.get("FA_NUMBA_SIM") == "1" or not has_gpu:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-4)  # the simulator runs one Python thread per CUDA thread: switch often

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, max_examples=300, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
