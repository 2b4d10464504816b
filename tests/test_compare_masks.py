"""`compare` and `sweep` with a block mask (issue 13): Shape.mask, the tables, the CLI's --mask and --tile-map.

Small simulator shapes (N <= 32, d <= 8, 8 x 8 tiles). The expected tile counts, visible pairs and masks
are recomputed here from the masks' definitions (test_masks.definition, brute force over every pair);
bytes are checked against iomodel, which test_mask_kernels checks against the counted kernels.
"""

import csv
import json

import numpy as np
import pytest

from fa_numba import cli, iomodel, masks, plots, tiling
from fa_numba import compare as cmp
from fa_numba.kernels import VARIANTS
from fa_numba.timing import attention_flops
from test_masks import definition

SIMULATOR = cmp.backend.name() == "simulator"
B, H, H_KV, D, TILE = 1, 2, 1, 8, 8
# the variants compare runs here: float32 on tiles of 8 (the tensor-core ones take tiles of 16: left out)
FLOAT32 = sorted(name for name, v in VARIANTS.items() if "float32" in v.dtypes and TILE % v.tile_multiple == 0)
# (spec, N_q, N_k): a window with N_q != N_k (delta = 8) and ragged tail tiles, documents whose boundaries
# cut tiles (FULL, PARTIAL and SKIP tiles all occur), and documents with causal.
CASES = [("window:6,2", 20, 28), ("documents:5,11,14", 30, 30), ("documents-causal:12,4,16", 32, 32)]


def _shape(spec, n_q, n_k, **kw) -> cmp.Shape:
    return cmp.Shape(batch=B, heads=H, heads_kv=H_KV, n_q=n_q, n_k=n_k, head_dim=D, mask=spec, block_q=TILE,
                     block_k=TILE, **kw)


def _brute_kinds(spec, n_q, n_k, block_q, block_k=None) -> np.ndarray:
    """(T_r, T_c) tile kinds from the mask's definition: SKIP if no pair of the tile is visible, FULL if all are."""
    block_k = block_k or block_q
    visible = definition(masks.parse(spec), n_q, n_k)
    return np.array([[tiling.SKIP if not t.any() else tiling.FULL if t.all() else tiling.PARTIAL
                      for t in (visible[r:r + block_q, c:c + block_k] for c in range(0, n_k, block_k))]
                     for r in range(0, n_q, block_q)], dtype=np.int8)


def test_the_cases_hold_what_they_claim():
    """Every kind of tile occurs across the cases, and each case skips something: the tests below can fail."""
    kinds = [_brute_kinds(spec, n_q, n_k, TILE) for spec, n_q, n_k in CASES]
    assert all((k == tiling.SKIP).any() for k in kinds)
    assert set(np.concatenate([k.ravel() for k in kinds]).tolist()) == {tiling.SKIP, tiling.FULL, tiling.PARTIAL}


@pytest.mark.parametrize("spec, n_q, n_k", CASES)
def test_compare_with_a_mask_passes_skips_its_tiles_and_counts_the_model(spec, n_q, n_k, tmp_path, capsys):
    path = tmp_path / "out.json"
    argv = ["compare", "--mask", spec, "--n-q", str(n_q), "--n-k", str(n_k), "--head-dim", str(D), "--heads", str(H),
            "--heads-kv", str(H_KV), "--block-q", str(TILE), "--block-k", str(TILE), "--json", str(path)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    mask = masks.parse(spec)
    assert f" mask={mask.describe()} " in text and " causal=" not in text  # the title names the mask
    result = json.loads(path.read_text())
    assert result["shape"]["mask"] == spec and result["shape"]["causal"] is False
    kinds = _brute_kinds(spec, n_q, n_k, TILE)
    classified = tiling.classify(n_q, n_k, TILE, TILE, mask=mask)
    visible_pairs = int(definition(mask, n_q, n_k).sum())
    assert [r["variant"] for r in result["rows"]] == FLOAT32  # the tensor-core ones: left out, with a note
    for row in result["rows"]:
        assert row["passed"] and row["err_out"] <= row["atol_out"] and row["err_lse"] <= row["atol_lse"]
        assert row["tiles_skipped"] == int((kinds == tiling.SKIP).sum()) * B * H
        assert row["tiles_skipped"] == int((classified == tiling.SKIP).sum()) * B * H
        assert row["tiles_masked"] == int((kinds == tiling.PARTIAL).sum()) * B * H
        assert row["tiles_computed"] + row["tiles_skipped"] == kinds.size * B * H
        model = iomodel.traffic(row["order"], n_q, n_k, D, TILE, TILE, batch=B, heads=H, heads_kv=H_KV, mask=mask)
        assert row["bytes_model"] == iomodel.to_bytes(model, 4)
        assert row["flops"] == 4 * B * H * D * visible_pairs
        if SIMULATOR:
            assert row["bytes_counted"] == row["bytes_model"]  # counted==model, element by element


def test_a_window_computes_fewer_tiles_and_moves_fewer_bytes_than_causal():
    """A window that looks back 6 keys and not ahead (causal cut to a band) drops tiles causal computes."""
    _, n_q, n_k = CASES[0]
    window = _shape("window:6,0", n_q, n_k).resolved()
    causal = _shape(None, n_q, n_k, causal=True).resolved()
    for order in ("v1", "v2"):
        w, c = cmp.analytic(window, order), cmp.analytic(causal, order)
        assert w["tiles_computed"] < c["tiles_computed"]
        assert w["bytes_total"] < c["bytes_total"]
        assert w["flops"] < c["flops"]


@pytest.mark.parametrize("spec, n_q, n_k", [CASES[0], CASES[1]])
def test_compare_backward_with_a_mask_passes_and_counts_the_model(spec, n_q, n_k, tmp_path):
    path = tmp_path / "bwd.json"
    argv = ["compare", "--backward", "--mask", spec, "--n-q", str(n_q), "--n-k", str(n_k), "--head-dim", str(D),
            "--heads", str(H), "--heads-kv", str(H_KV), "--block-q", str(TILE), "--block-k", str(TILE),
            "--json", str(path)]
    assert cli.main(argv) == 0
    result = json.loads(path.read_text())
    mask = masks.parse(spec)
    kinds = _brute_kinds(spec, n_q, n_k, TILE)
    assert [r["variant"] for r in result["rows"]] == list(cmp.BACKWARD_VARIANTS)
    for row in result["rows"]:
        assert row["passed"]
        assert all(row[f"err_{g}"] <= row[f"atol_{g}"] for g in ("dq", "dk", "dv"))
        assert row["tiles_skipped"] == int((kinds == tiling.SKIP).sum()) * B * H
        model = iomodel.traffic_backward(row["order"], n_q, n_k, D, TILE, TILE, batch=B, heads=H, heads_kv=H_KV,
                                         deterministic=row["deterministic"], mask=mask)
        assert row["bytes_model"] == iomodel.to_bytes(model, 4)
        if SIMULATOR:
            assert row["bytes_counted"] == row["bytes_model"]


def test_a_mask_of_causal_form_runs_the_causal_kernels():
    """--mask causal (and window:inf,0, its other spelling) is --causal: the closed forms, as fa_numba.attention
    launches it, so the same tiles, bytes and outputs (bit for bit: the same kernels on the same inputs)."""
    by_mask = _shape("window:inf,0", 20, 28).resolved()
    assert by_mask.mask == "causal" and cmp.masking(by_mask) == (True, None, "causal")
    results = [cmp.run(s, ["v2"], count=False) for s in (by_mask, _shape(None, 20, 28, causal=True))]
    (a,), (b,) = (r["rows"] for r in results)
    assert a["passed"] and b["passed"]
    for key in ("tiles_computed", "tiles_skipped", "tiles_masked", "bytes_model", "err_out", "err_lse"):
        assert a[key] == b[key], key
    assert a["flops"] == b["flops"] == attention_flops(B, H, 20, 28, D, causal=True)


@pytest.mark.parametrize("kw, error, message", [
    (dict(mask="window:8"), ValueError, "window needs two values LEFT,RIGHT"),
    (dict(mask="stripes:3"), ValueError, "expected one of \"causal\", \"window:LEFT,RIGHT\""),
    (dict(mask="window:8,0", causal=True), ValueError, "pass causal=True or mask=..., not both"),
    (dict(mask="documents:8,8", n_q=20), ValueError,
     "mask 'documents:8,8' does not fit N_q=20, N_k=20: .* needs n_q = n_k = sum\\(lengths\\) = 16"),
    (dict(mask=masks.from_function(lambda i, j: i >= j)), TypeError, "has none: call fa_numba.attention"),
])
def test_shape_refuses_a_bad_mask_by_name(kw, error, message):
    with pytest.raises(error, match=message):
        cmp.Shape(**{"n_q": 16, **kw}).resolved()


def test_shape_takes_a_mask_object_with_a_spec_and_keeps_its_text():
    shape = cmp.Shape(n_q=16, mask=masks.sliding_window(4, None), block_q=8, block_k=8).resolved()
    assert shape.mask == "window:4,inf" and json.loads(json.dumps(shape.mask)) == shape.mask
    assert cmp.masking(shape) == (False, masks.sliding_window(4, None), "intervals")


@pytest.mark.parametrize("argv, message", [
    (["compare", "--mask", "window:8,0", "--causal"], "argument --mask: not allowed with --causal"),
    (["compare", "--mask", "window:8"], "argument --mask: mask 'window:8': window needs two values"),
    (["compare", "--mask", "prefix:x"], "argument --mask: mask 'prefix:x': P must be an int"),
    (["compare", "--mask", "documents:8,8", "--n-q", "20"],
     "argument --mask: mask 'documents:8,8' does not fit N_q=20, N_k=20"),
    (["compare", "--backward", "--mask", "documents:8,8", "--n-q", "16", "--n-k", "20"],
     "argument --mask: mask 'documents:8,8' does not fit N_q=16, N_k=20"),
    (["sweep", "--n", "16", "--mask", "window:8,0", "--causal", "on"], "argument --mask: not allowed with --causal on"),
    (["sweep", "--n", "16", "--mask", "window:8,0", "--causal", "both"],
     "argument --mask: not allowed with --causal both"),
    (["sweep", "--n", "16,32", "--mask", "documents:8,8"], "argument --mask: mask 'documents:8,8' does not fit N_q=32"),
])
def test_mask_argument_errors_exit_2_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: fa_numba {argv[0]} " in err and f"fa_numba {argv[0]}: error: {message}" in err  # its own usage


def test_sweep_with_a_mask_has_the_mask_column_and_its_bytes(tmp_path, capsys):
    path = tmp_path / "s.csv"
    spec = "window:4,0"
    assert cli.main(["sweep", "--n", "16,24", "--head-dims", "4", "--mask", spec, "--block-q", "8", "--block-k", "8",
                     "--no-count", "--csv", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split()[:5] == ["N", "d", "causal", "mask", "tile"]
    assert f" {spec} " in out.out and f"mask={spec}" in out.err  # table and progress
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == cli.CSV_FIELDS and "mask" in cli.CSV_FIELDS
    assert len(rows) == 2 * len(FLOAT32) and {r["mask"] for r in rows} == {spec}
    for row in rows:
        n = int(row["n"])
        kinds = _brute_kinds(spec, n, n, 8)
        assert row["passed"] == "True" and int(row["tiles_skipped"]) == int((kinds == tiling.SKIP).sum()) * 2
        model = iomodel.traffic(VARIANTS[row["variant"]].order, n, n, 4, 8, 8, heads=2, mask=masks.parse(spec))
        assert int(row["bytes_total"]) == iomodel.total_bytes(model, 4)


def _capture_tile_map(monkeypatch) -> list[dict]:
    """Wrap plots.tile_map to record its arguments, still drawing the PNG."""
    calls, real = [], plots.tile_map

    def capture(kinds, n_q, n_k, block_q, block_k, path, **kw):
        calls.append(dict(kinds=np.array(kinds), n=(n_q, n_k), tiles=(block_q, block_k), **kw))
        real(kinds, n_q, n_k, block_q, block_k, path, **kw)

    monkeypatch.setattr(plots, "tile_map", capture)
    return calls


@pytest.mark.parametrize("spec, causal, expected_label", [
    ("documents:12,4,16", "off", "mask documents(12, 4, 16)"),
    (None, "on", "causal"),
    (None, "off", "causal (for reference: this sweep ran unmasked, every tile FULL)"),
])
def test_sweep_tile_map_draws_the_swept_mask(spec, causal, expected_label, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="--tile-map needs the optional 'plot' extra (matplotlib)")
    calls = _capture_tile_map(monkeypatch)
    png = tmp_path / "tiles.png"
    argv = ["sweep", "--n", "32", "--head-dims", "4", "--block-q", "4", "--block-k", "8", "--causal", causal,
            "--orders", "v2", "--no-count", "--tile-map", str(png)] + (["--mask", spec] if spec else [])
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    (call,) = calls
    assert call["n"] == (32, 32) and call["tiles"] == (4, 8)
    assert call["label"] == expected_label
    np.testing.assert_array_equal(call["kinds"], tiling.classify(32, 32, 4, 8, mask=masks.parse(spec or "causal")))
    # and against the definition itself, tile by tile
    np.testing.assert_array_equal(call["kinds"], _brute_kinds(spec or "causal", 32, 32, 4, 8))
