"""Test configuration: CUDA simulator without a GPU, Hypothesis profiles.

Importing fa_numba first lets fa_numba.backend choose the simulator (NUMBA_ENABLE_CUDASIM=1) before numba
is imported when no NVIDIA driver is visible; with a GPU the same tests run on the device
(FA_NUMBA_SIM=1 forces the simulator there too).
"""

import json
import os
import pathlib
import sys

import fa_numba

if fa_numba.backend.name() == "simulator":
    sys.setswitchinterval(1e-4)  # the simulator runs one Python thread per CUDA thread: switch often

import pytest  # noqa: E402
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


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: the map holds every collected test
def pytest_collection_modifyitems(session, config, items):
    """{test id: [lemmas it is marked with]} of every collected test, kept on the config as `fa_numba_lemmas`
    when this session collects the whole tests/ directory (test_proofs reads it instead of collecting the
    suite again in a subprocess); with FA_NUMBA_LEMMA_MAP=path, also written there."""
    lemmas = {item.nodeid: [m.args[0] for m in item.iter_markers("lemma")] for item in items}
    here = pathlib.Path(__file__).resolve().parent
    roots = [pathlib.Path(str(arg)).resolve() for arg in config.args]
    if roots and all("::" not in str(arg) for arg in config.args) and any(r == here or r in here.parents
                                                                          for r in roots):
        config.fa_numba_lemmas = lemmas
    path = os.environ.get("FA_NUMBA_LEMMA_MAP")
    if path:
        with open(path, "w") as fh:
            json.dump(lemmas, fh)
