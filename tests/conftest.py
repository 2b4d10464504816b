"""Test configuration: CUDA simulator without a GPU, Hypothesis profiles.

Importing fa_numba first lets fa_numba.backend choose the simulator (NUMBA_ENABLE_CUDASIM=1) before numba
is imported when no NVIDIA driver is visible; with a GPU the same tests run on the device
(FA_NUMBA_SIM=1 forces the simulator there too).
"""

import json
import os
import sys

import fa_numba

if fa_numba.backend.name() == "simulator":
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


def pytest_collection_modifyitems(session, config, items):
    """With FA_NUMBA_LEMMA_MAP=path, write {test id: [lemmas it is marked with]} (read by test_proofs)."""
    path = os.environ.get("FA_NUMBA_LEMMA_MAP")
    if path:
        with open(path, "w") as fh:
            json.dump({item.nodeid: [m.args[0] for m in item.iter_markers("lemma")] for item in items}, fh)
