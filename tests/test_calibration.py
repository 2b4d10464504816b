"""The whole-kernel model against the GPU: every calibration row (benchmarks/results/calibration_h200_2026-12-04.json,
the first GPU session's rows timed with the GPU alone whose kernel the model prices, beside the counts of the code
that ran) is predicted within 25% of its measured time by `whole_kernel.estimate_configuration` reading those
counts, but the one documented exception (`MISSES`), and so is each row when the model's two least certain
constants (HBM's latency, the L1 tag rate) are fitted on the other rows only. No compiler, no simulator: the
rows carry their counts, wavefronts and lines."""

import dataclasses
import json
import math
import pathlib

import pytest

from fa_numba import whole_kernel
from fa_numba.machine import H200

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CALIBRATION = json.loads((RESULTS / "calibration_h200_2026-12-04.json").read_text())
ROWS = CALIBRATION["rows"]
TOLERANCE = 0.25  # |predicted / measured - 1|
CONFIG_KEYS = ("variant", "block_q", "block_k", "head_dim", "dtype", "causal")
# The rows the model does not predict within the tolerance, and why (a term it lacks, not a factor to fit).
MISSES = {
    "bwd-kv-mma-float32-d128": (
        "measured 1.7x the model's time. Six one-warp blocks share an SM: the model pools the four sub-partitions, "
        "while two of them hold two of these warps, whose ALU-bound 3xTF32 splits walk 21359 cycles together "
        "against 13451 alone (pricing that pair gives 1.3x, still out); left unmodelled: the 256 key blocks of a "
        "head adding into the same dQ rows in the same order (same-address atomics serialised at L2), and the "
        "instruction fetch of a 6848-instruction (110 KB) straight-line loop body by warps at independent PCs"),
}


def _name(row: dict) -> str:
    return f"{row['kernel']}-{row['dtype']}-d{row['d']}" + ("-causal" if row["causal"] else "")


def _cases():
    return [pytest.param(row, id=_name(row), marks=pytest.mark.xfail(strict=True, reason=MISSES[_name(row)]))
            if _name(row) in MISSES else pytest.param(row, id=_name(row)) for row in ROWS]


def predicted_seconds(row: dict, device=H200) -> float:
    """The model's time of a calibration row's call, read from the row's counts (what profile does)."""
    c = row["config"]
    cfg = {k: c[k] for k in CONFIG_KEYS}
    found, why = whole_kernel.estimate_configuration(cfg, row["counts"], row["occupancy"], tuple(c["launch"]["grid"]),
                                                     tuple(c["launch"]["block"]), row["wavefronts"], c["launch"],
                                                     device, global_lines=row["global_lines"])
    assert found is not None, why
    return found.seconds


def _session_rows() -> dict:
    out = {}
    for name in {row["run"] for row in ROWS}:
        for line in (RESULTS / name).read_text().splitlines():
            if line.strip():
                found = json.loads(line)
                out[(name, found["id"])] = found
    return out


def test_the_rows_are_the_sessions_clean_rows_beside_the_counts_of_the_code_that_ran():
    session = _session_rows()
    estimates = {(p["config"]["variant"], p["config"]["dtype"], p["config"]["head_dim"], p["config"]["causal"]): p
                 for p in json.loads((RESULTS / CALIBRATION["estimate_file"]).read_text())["profiles"]}
    for row in ROWS:
        measured = session[(row["run"], row["id"])]
        assert measured["ms"] == row["measured_ms"] and not measured.get("suspect") and measured["passed"]
        assert (measured["dtype"], measured["d"], measured["causal"]) == (row["dtype"], row["d"], row["causal"])
        committed = estimates[(row["kernel"], row["dtype"], row["d"], row["causal"])]
        # the recount is of the code the estimate file counted: every key it has, equal; the traced wavefronts too
        assert {k: row["counts"][k] for k in committed["counts"]} == committed["counts"], _name(row)
        assert row["wavefronts"] == committed["estimate"]["wavefronts"] and "walk" in row["counts"]
        assert (row["occupancy"], row["config"]["launch"]) == (committed["occupancy"], committed["config"]["launch"])
    # every clean row the estimate file prices is here, once: 16 kernels x dtypes x d (one causal)
    assert len({(r["kernel"], r["dtype"], r["d"], r["causal"]) for r in ROWS}) == len(ROWS) == 16


@pytest.mark.parametrize("row", _cases())
def test_the_model_predicts_each_measured_row_within_a_quarter(row):
    predicted = predicted_seconds(row)
    assert abs(predicted / (row["measured_ms"] * 1e-3) - 1) <= TOLERANCE, f"predicted {predicted * 1e3:.3f} ms"


# The constants no document fixes: HBM's load-to-use latency (cycles) and the L1 tag stage's lines per cycle.
# Each row left out, the pair that predicts the other rows best (least squares of log(predicted / measured))
# predicts it; the grid spans the published range of the one (and more) and a factor of 2 either side of the
# other. The documented misses are neither fitted nor judged.
HBM_LATENCIES = tuple(range(300, 1201, 100))
L1_RATES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def leave_one_out() -> dict:
    """{row name: (the grid point fitted on the other rows, the left-out row's predicted / measured - 1)}."""
    rows = [row for row in ROWS if _name(row) not in MISSES]
    grid = [(latency, rate) for latency in HBM_LATENCIES for rate in L1_RATES]
    errors = {}  # (grid point, row index): log(predicted / measured)
    for point in grid:
        device = dataclasses.replace(H200, hbm_latency_cycles=point[0], l1_lines_per_cycle=point[1])
        for k, row in enumerate(rows):
            errors[point, k] = math.log(predicted_seconds(row, device) / (row["measured_ms"] * 1e-3))
    out = {}
    for k, row in enumerate(rows):
        fitted = min(grid, key=lambda p: sum(errors[p, j] ** 2 for j in range(len(rows)) if j != k))
        out[_name(row)] = fitted, math.exp(errors[fitted, k]) - 1
    return out


def test_leave_one_out_the_fitted_constants_still_predict_the_row_left_out():
    for name, (fitted, left_out) in leave_one_out().items():
        assert abs(left_out) <= TOLERANCE, f"{name}: fitted {fitted} on the others, predicted {left_out:+.0%}"
