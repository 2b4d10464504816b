"""`python -m fa_numba compare | sweep` on tiny shapes: table, JSON consistent with iomodel, usage errors."""

import argparse
import csv
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fa_numba import cli, iomodel, tolerance
from fa_numba.kernels import VARIANTS
from fa_numba import compare as cmp

TINY = ["--n-q", "20", "--n-k", "28", "--head-dim", "4", "--block-q", "8", "--block-k", "8"]


def test_compare_prints_every_variant_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = cli.main(["compare", *TINY, "--causal", "--heads", "2", "--heads-kv", "1", "--json", str(path)])
    assert code == 0
    text = capsys.readouterr().out
    for name in ("v1", "v2"):
        assert f"\n{name} " in text
    assert "FAIL" not in text
    result = json.loads(path.read_text())
    assert set(result) >= {"machine", "shape", "rows", "ran", "notes"}
    assert set(result["machine"]) >= {"device", "backend", "numba", "numba_cuda", "numpy", "python", "date"}
    assert result["shape"] == dict(batch=1, heads=2, heads_kv=1, n_q=20, n_k=28, head_dim=4, causal=True, mask=None,
                                   dtype="float32", block_q=8, block_k=8, seed=0, tiles="chosen")
    assert "\ntiles: 8x8 (chosen)\n" in text
    for row in result["rows"]:
        model = iomodel.traffic(row["order"], 20, 28, 4, 8, 8, True, heads=2, heads_kv=1)
        assert row["bytes_model"] == iomodel.to_bytes(model, 4)
        assert row["passed"] and row["err_out"] <= row["atol_out"]
        assert row["tiles_computed"] + row["tiles_skipped"] == 2 * 3 * 4
        if result["machine"]["backend"] == "simulator":
            assert row["bytes_counted"] == row["bytes_model"]  # the kernels' counted accesses


def test_a_failing_variant_is_reported_and_exits_1(monkeypatch, capsys):
    real_run = cmp.run

    def corrupt(shape, variants=None, **kw):
        result = real_run(shape, variants, **kw)
        result["rows"][0].update(passed=False, failure="planted failure")
        return result

    monkeypatch.setattr(cmp, "run", corrupt)
    assert cli.main(["compare", *TINY, "--no-count"]) == 1
    assert "FAILED its check and was not timed: planted failure" in capsys.readouterr().out


def test_too_large_for_the_simulator_is_refused_with_analytic_columns(capsys):
    shape = cmp.Shape(n_q=4096, head_dim=64)
    feasible, why = cmp.simulator_feasible(shape)
    assert not feasible and "too large for the CUDA simulator" in why and "feasible here" in why
    if cmp.backend.name() == "simulator":
        assert cli.main(["compare", "--n-q", "4096", "--head-dim", "64", "--block-q", "64", "--block-k", "32"]) == 0
        out = capsys.readouterr().out
        assert "too large for the CUDA simulator" in out
        result = cmp.run(shape)
        assert not result["ran"] and all("passed" not in r for r in result["rows"])
        for row in result["rows"]:  # the analytic columns are still there: 64 x 32 tiles of 64 x 128, H = 2
            assert row["tiles_computed"] == 64 * 128 * 2 and f" {row['tiles_computed']} " in out
            assert row["bytes_total"] == iomodel.total_bytes(iomodel.traffic(row["order"], 4096, 4096, 64, 64, 32,
                                                                              False, heads=2), 4)


def test_analytic_columns_use_the_tiles_a_launch_would_use(tmp_path, capsys):
    """A shape too large for the simulator is described with fa_numba.attention's tiles for d (64 x 32 at
    d = 64), not the simulator's 16 x 16 (which overstated v1's traffic 2x at N = 100,000), and says so."""
    shape = cmp.Shape(n_q=4096, head_dim=64).resolved()
    assert (shape.block_q, shape.block_k, shape.tiles) == (64, 32, "default for d=64")
    assert cmp.Shape(n_q=4096, head_dim=128).resolved().block_k == 16  # default_tiles(128) = (64, 16)
    chosen = cmp.Shape(n_q=4096, head_dim=64, block_q=16, block_k=16).resolved()
    assert (chosen.block_q, chosen.block_k, chosen.tiles) == (16, 16, "chosen")
    one = cmp.Shape(n_q=4096, head_dim=64, block_k=16).resolved()
    assert (one.block_q, one.block_k, one.tiles) == (64, 16, "block_k chosen, block_q default for d=64")
    assert cmp.Shape(n_q=4096, head_dim=64).resolved(simulator_tiles=False) == shape
    for (tq, tk), flags, line in (((64, 32), [], "tiles: 64x32 (default for d=64)"),
                                  ((16, 16), ["--block-q", "16", "--block-k", "16"], "tiles: 16x16 (chosen)")):
        path = tmp_path / f"{tq}x{tk}.json"
        argv = ["compare", "--batch", "1", "--heads", "2", "--n-q", "4096", "--head-dim", "64", "--no-count",
                "--repeats", "1", "--json", str(path), *flags]
        assert cli.main(argv) == 0
        assert f"\n{line}\n" in capsys.readouterr().out
        result = json.loads(path.read_text())
        assert (result["shape"]["block_q"], result["shape"]["block_k"]) == (tq, tk)
        for row in result["rows"]:
            model = iomodel.traffic(row["order"], 4096, 4096, 64, tq, tk, False, heads=2)
            assert row["bytes_total"] == iomodel.total_bytes(model, 4)
            assert row["tiles_computed"] == (4096 // tq) * (4096 // tk) * 2


def test_readme_numbers_for_a_shape_too_large_for_the_simulator():
    """docs/compare.md: at B = 1, H = 2, N = 100,000, d = 64, v1 moves 456.5 GiB with 64 x 32 tiles, 912.8 with 16 x 16."""
    gib = [iomodel.total_bytes(iomodel.traffic("v1", 100_000, 100_000, 64, tq, tk, False, heads=2), 4) / 2**30
           for tq, tk in ((64, 32), (16, 16))]
    assert [f"{g:.1f}" for g in gib] == ["456.5", "912.8"]
    assert cmp.Shape(n_q=100_000, head_dim=64).resolved().block_q == 64


@pytest.mark.slow  # ~15-30 s in the simulator: the slow tier
@pytest.mark.skipif(cmp.backend.name() != "simulator", reason="the simulator's small default tiles")
def test_simulator_runs_small_shapes_with_small_tiles_and_says_so(capsys):
    shape = cmp.Shape().resolved()  # compare's default in the simulator: N = 64, d = 16
    assert (shape.block_q, shape.block_k) == (16, 16)
    assert shape.tiles == "simulator default; fa_numba.attention would use 64x64, the default for d=16"
    one = cmp.Shape(block_q=8).resolved()
    assert (one.block_q, one.block_k) == (8, 16)
    assert one.tiles == "block_q chosen, block_k simulator default; fa_numba.attention would use 8x64"
    assert cli.main(["compare", "--no-count"]) == 0
    assert f"\ntiles: 16x16 ({shape.tiles})\n" in capsys.readouterr().out


@pytest.mark.slow  # ~15-30 s in the simulator: the slow tier
def test_sweep_keeps_one_tile_size_when_the_simulator_runs_only_some_sizes(tmp_path):
    path = tmp_path / "s.csv"
    assert cli.main(["sweep", "--n", "16,4096", "--head-dims", "16", "--no-count", "--csv", str(path)]) == 0
    rows = list(csv.DictReader(path.open()))
    assert {r["tile_size"] for r in rows} == {"64x64"}  # default_tiles(16), for N = 16 as for N = 4096
    for row in rows:
        n = int(row["n"])
        model = iomodel.traffic(VARIANTS[row["variant"]].order, n, n, 16, 64, 64, False, heads=2)
        assert int(row["bytes_total"]) == iomodel.total_bytes(model, 4)


def test_sweep_writes_csv_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plots need the optional 'plot' extra (matplotlib)")
    paths = {k: tmp_path / f"s.{k}" for k in ("csv", "json")}
    plot, tile_map = tmp_path / "traffic.png", tmp_path / "tiles.png"
    code = cli.main(["sweep", "--n", "16,24", "--head-dims", "4", "--causal", "both", "--block-q", "8",
                     "--block-k", "8", "--no-count", "--csv", str(paths["csv"]), "--json", str(paths["json"]),
                     "--plot", str(plot), "--tile-map", str(tile_map)])
    assert code == 0
    rows = list(csv.DictReader(paths["csv"].open()))
    # sizes x causal x the variants that take float32 on 8 x 8 tiles (v1-mma, v2-mma need 16: left out with a note)
    assert len(rows) == 2 * 2 * len([v for v in VARIANTS.values() if "float32" in v.dtypes and v.tile_multiple == 1])
    for row in rows:
        n, causal = int(row["n"]), row["causal"] == "True"
        model = iomodel.traffic(VARIANTS[row["variant"]].order, n, n, 4, 8, 8, causal, heads=2)
        assert int(row["bytes_total"]) == iomodel.total_bytes(model, 4)
    assert len(json.loads(paths["json"].read_text())["results"]) == 4
    for png in (plot, tile_map):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    captured = capsys.readouterr()
    assert "[4/4] N=24 d=4 causal=True" in captured.err  # progress on stderr
    # the table's S MiB column is explained under it: the N_q x N_k float32 scores a dense attention stores
    (note,) = [line for line in captured.out.splitlines() if line.startswith("S MiB:")]
    assert "N_q N_k" in note and "float32" in note and "dense" in note


@pytest.mark.parametrize("argv, message", [
    (["compare", "--block-q", "0"], "--block-q: expected a positive integer"),
    (["compare", "--orders", "v3"], "--orders: expected a comma list"),
    (["compare", "--dtype", "int8"], "--dtype: invalid choice"),
    ([], "required: command"),
    (["compare", "--heads", "3", "--heads-kv", "2"], "--heads-kv: 2 must divide --heads (3)"),
    (["compare", "--head-dim", "512"], "argument --head-dim: expected a head dim of at most 256"),
    (["compare", "--head-dim", "64", "--block-k", "512"], "block_k = 512 with d = 64 need"),
    (["compare", "--head-dim", "64", "--block-q", "64", "--block-k", "64"], "block_q = 64, block_k = 64 with d = 64 need"),
    (["sweep"], "the following arguments are required: --n"),
    (["sweep", "--n", "16,x"], "--n: expected a positive integer"),
    (["compare", "--decode", "--causal"], "--decode: not allowed with --causal"),
    (["compare", "--split-size", "16"], "--split-size: only with --decode"),
    (["compare", "--decode", "--n-k", "40", "--split-size", "12"], "split_size must be a positive multiple of block_k"),
])
def test_bad_arguments_exit_2_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "fa_numba", "compare", *TINY, "--no-count"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "v2" in done.stdout


def test_compare_backward_prints_every_backward_variant_with_counts(tmp_path, capsys):
    path = tmp_path / "bwd.json"
    code = cli.main(["compare", "--backward", *TINY, "--causal", "--heads", "2", "--heads-kv", "1", "--json", str(path)])
    assert code == 0
    text = capsys.readouterr().out
    for name in cmp.BACKWARD_VARIANTS:
        assert f"\n{name} " in text
    result = json.loads(path.read_text())
    assert result["backward"] and [r["variant"] for r in result["rows"]] == list(cmp.BACKWARD_VARIANTS)
    for row in result["rows"]:
        model = iomodel.traffic_backward(row["order"], 20, 28, 4, 8, 8, True, heads=2, heads_kv=1,
                                         deterministic=row["deterministic"])
        assert row["bytes_model"] == iomodel.to_bytes(model, 4)
        assert row["passed"] and row["err_dq"] <= row["atol_dq"] and row["err_dk"] <= row["atol_dk"]
        if result["machine"]["backend"] == "simulator":
            assert row["bytes_counted"] == row["bytes_model"]


@pytest.mark.parametrize("argv, message", [
    (["compare", "--backward", "--orders", "v2"], "with --backward, expected a comma list of kv, kv-deterministic, q"),
    (["compare", "--orders", "kv"], "backward variants need --backward"),
    (["compare", "--backward", "--block-q", "8", "--block-k", "4"], "need square tiles"),
])
def test_backward_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Issue 20, item 10: user errors exit 2 with the subcommand's usage and a one-line message naming the option,
# never a traceback, and output paths are checked before anything runs.

SWEEP_TINY = ["--n", "16", "--head-dims", "4", "--block-q", "8", "--block-k", "8", "--orders", "v2", "--no-count"]


def _usage_error(argv, capsys) -> str:
    """Run argv, which must be refused as a usage error: exit 2, the subcommand's usage, no traceback, and the
    message on one line (argparse's `prog: error: ...`, the last line of stderr). Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("usage: fa_numba ")
    last = captured.err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"fa_numba {argv[0]}: error: argument ")
    return last


@pytest.fixture
def no_run(monkeypatch):
    """compare.run / run_backward fail the test if called: the errors below must come before any run."""
    def refuse(*args, **kwargs):
        raise AssertionError("the command ran before refusing its arguments")

    monkeypatch.setattr(cmp, "run", refuse)
    monkeypatch.setattr(cmp, "run_backward", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--decode", "--ring", "2"], "--ring: not allowed with --decode"),
    (["--ring", "2", "--decode"], "--ring: not allowed with --decode"),
    (["--ring", "2", "--backward"], "--ring: not allowed with --backward"),
    (["--ring", "2", "--split-size", "16"], "--ring: not allowed with --split-size"),
    (["--ring", "2", "--block-q", "16"], "--ring: not allowed with --block-q"),
    (["--ring", "2", "--block-k", "16"], "--ring: not allowed with --block-k"),
    (["--ring", "2", "--orders", "v2"], "--ring: not allowed with --orders"),
    (["--ring", "2", "--rep", "3"], "--ring: not allowed with --repeats"),  # an abbreviation is the option
    (["--ring", "2", "--seed", "0"], "--ring: not allowed with --seed"),  # so is the default value, typed
    (["--ring", "2", "--no-count"], "--ring: not allowed with --no-count"),
    (["--ring", "2", "--json", "{tmp}/ring.json"], "--ring: not allowed with --json"),
    (["--decode", "--orders", "v2"], "--decode: not allowed with --orders"),
    (["--decode", "--block-q", "4"], "--decode: not allowed with --block-q"),
    (["--ring", "2", "--head-dim", "1000"], "--head-dim: expected a head dim of at most 256"),
    (["--decode", "--head-dim", "257"], "--head-dim: expected a head dim of at most 256"),
    (["--head-dim", "0"], "--head-dim: expected a positive integer"),
])
def test_options_decode_and_ring_do_not_use_are_refused_before_anything_runs(argv, message, tmp_path, capsys, no_run,
                                                                            monkeypatch):
    """--decode and --ring each take a part of compare's options: any other is refused by name (exit 2, one line
    naming both options), never silently dropped, and before a kernel or the ring model runs."""
    from fa_numba import compare_decode, ring_model

    monkeypatch.setattr(compare_decode, "run", lambda *a, **k: pytest.fail("decoding ran before refusing"))
    monkeypatch.setattr(ring_model, "ring_steps", lambda *a, **k: pytest.fail("the ring model ran before refusing"))
    line = _usage_error(["compare", *(a.format(tmp=tmp_path) for a in argv)], capsys)
    assert line.startswith(f"fa_numba compare: error: argument {message}"), line
    assert not (tmp_path / "ring.json").exists()


def test_sweep_refuses_a_head_dim_over_the_cap(capsys, no_run):
    line = _usage_error(["sweep", "--n", "16", "--head-dims", "16,300"], capsys)
    assert "argument --head-dims: expected a head dim of at most 256" in line and line.endswith("got 300")


def test_compare_ring_takes_the_options_it_models(capsys):
    """The control of the refusals above: the options the ring model reads, the largest head dim included."""
    argv = ["compare", "--ring", "2", "--n-q", "64", "--batch", "2", "--heads", "2", "--heads-kv", "1", "--head-dim",
            "256", "--dtype", "float16", "--causal"]
    assert cli.main(argv) == 0
    assert "ring attention, W=2, zigzag: B=2 H=2 N=64 d=256 float16, causal" in capsys.readouterr().out


OUTPUTS = [("compare", [*TINY], "--json", "out.json"), ("sweep", SWEEP_TINY, "--json", "out.json"),
           ("sweep", SWEEP_TINY, "--csv", "out.csv"), ("sweep", SWEEP_TINY, "--plot", "out.png"),
           ("sweep", SWEEP_TINY, "--tile-map", "out.png")]


@pytest.mark.parametrize("command, flags, option, name", OUTPUTS)
def test_an_output_into_a_missing_directory_is_refused_before_the_run(command, flags, option, name, tmp_path,
                                                                      capsys, no_run):
    if option in ("--plot", "--tile-map"):
        pytest.importorskip("matplotlib", reason="--plot and --tile-map need the optional 'plot' extra")
    path = tmp_path / "missing" / name
    line = _usage_error([command, *flags, option, str(path)], capsys)
    assert f"argument {option}: " in line and "does not exist" in line and str(path.parent) in line
    assert not path.parent.exists()


@pytest.mark.parametrize("command, flags, option, name", OUTPUTS)
def test_an_output_that_is_a_directory_is_refused_before_the_run(command, flags, option, name, tmp_path, capsys,
                                                                  no_run):
    if option in ("--plot", "--tile-map"):
        pytest.importorskip("matplotlib", reason="--plot and --tile-map need the optional 'plot' extra")
    line = _usage_error([command, *flags, option, str(tmp_path)], capsys)
    assert f"argument {option}: {tmp_path} is a directory" in line


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes a file whatever its mode (the /proc case below covers root)")
@pytest.mark.parametrize("command, flags, option, name", OUTPUTS)
def test_a_read_only_output_file_is_refused_before_the_run(command, flags, option, name, tmp_path, capsys, no_run):
    if option in ("--plot", "--tile-map"):
        pytest.importorskip("matplotlib", reason="--plot and --tile-map need the optional 'plot' extra")
    path = tmp_path / name
    path.write_text("keep me")
    path.chmod(0o444)
    line = _usage_error([command, *flags, option, str(path)], capsys)
    assert f"argument {option}: cannot write {path}" in line
    assert path.read_text() == "keep me"  # the check never truncates


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs Linux /proc (a file nobody may write)")
@pytest.mark.parametrize("command, flags, option", [(c, f, o) for c, f, o, _ in OUTPUTS])
def test_an_unwritable_output_file_is_refused_before_the_run(command, flags, option, capsys, no_run):
    if option in ("--plot", "--tile-map"):
        pytest.importorskip("matplotlib", reason="--plot and --tile-map need the optional 'plot' extra")
    line = _usage_error([command, *flags, option, "/proc/version"], capsys)
    assert f"argument {option}: cannot write /proc/version" in line


@pytest.mark.parametrize("option", ["--plot", "--tile-map"])
def test_a_plot_format_matplotlib_cannot_save_is_refused_before_the_run(option, tmp_path, capsys, no_run):
    pytest.importorskip("matplotlib", reason="--plot and --tile-map need the optional 'plot' extra")
    line = _usage_error(["sweep", *SWEEP_TINY, option, str(tmp_path / "out.xyz")], capsys)
    assert f"argument {option}: " in line and "'xyz'" in line and "png" in line
    assert not (tmp_path / "out.xyz").exists()  # the check leaves no file behind


def test_the_output_check_leaves_no_file_and_keeps_an_existing_one(tmp_path, capsys):
    """The check opens the path without truncating: an existing file is only replaced by the real write, and
    a refused command (here --seed) leaves no empty file behind."""
    new = tmp_path / "new.json"
    _usage_error(["compare", *TINY, "--json", str(new), "--seed", "-1"], capsys)
    assert not new.exists()


@pytest.mark.parametrize("command, flags", [("compare", TINY), ("sweep", SWEEP_TINY)])
@pytest.mark.parametrize("seed", ["-1", "-99999999999999999999"])
def test_a_seed_numpy_refuses_is_a_usage_error(command, flags, seed, capsys, no_run):
    with pytest.raises(ValueError):  # the premise: numpy's default_rng refuses it
        np.random.default_rng(int(seed))
    line = _usage_error([command, *flags, "--seed", seed], capsys)
    assert "argument --seed: expected a non-negative integer" in line and seed in line


HUGE = "99999999999999999999"  # > 2**64: no int32 (nor int64) index holds it


@pytest.mark.parametrize("command, flags", [("compare", TINY), ("sweep", SWEEP_TINY)])
@pytest.mark.parametrize("spec", [f"window:{HUGE},0", f"window:0,{HUGE}", f"prefix:{HUGE}", f"documents:{HUGE}",
                                  f"documents:8,{HUGE}", f"documents-causal:{HUGE},8", "window:2147483648,0",
                                  "prefix:2147483648"])
def test_mask_integers_beyond_int32_are_a_usage_error_naming_the_limit(command, flags, spec, capsys, no_run):
    """The kernels index in int32: masks.parse refuses integers > 2**31 - 1 and the CLI turns that into a
    usage error naming --mask and the limit (before, 99999999999999999999 crashed deep in NumPy)."""
    line = _usage_error([command, *flags, "--mask", spec], capsys)
    assert "argument --mask: " in line and ("2147483647" in line or "2**31" in line)


@pytest.mark.parametrize("argv", [["compare", "--n-q", HUGE], ["compare", "--n-k", HUGE], ["compare", "--batch", HUGE],
                                  ["compare", "--heads", "2147483648"], ["sweep", "--n", f"16,{HUGE}"]])
def test_sizes_beyond_int32_are_a_usage_error_naming_the_limit(argv, capsys, no_run):
    """Before, --n-q 99999999999999999999 ended in NumPy's 'Maximum allowed dimension exceeded' traceback."""
    line = _usage_error(argv, capsys)
    assert f"argument {argv[1]}: expected a positive integer <= 2147483647" in line


@pytest.mark.parametrize("error", [ValueError("mask 'x': too large"), TypeError("mask 'x': not an int"),
                                   OverflowError("Python int too large to convert to C long")])
def test_every_error_masks_parse_raises_is_a_usage_error(error, monkeypatch, capsys, no_run):
    def parse(text):
        raise error

    monkeypatch.setattr(cli.masks, "parse", parse)
    line = _usage_error(["compare", *TINY, "--mask", "window:4,0"], capsys)
    assert line.endswith(f"argument --mask: {error}")


def test_compare_takes_bfloat16_and_judges_it_by_the_reference_rule(tmp_path, capsys):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes (the test extra)")
    path = tmp_path / "bf16.json"
    assert cli.main(["compare", *TINY, "--causal", "--dtype", "bfloat16", "--json", str(path)]) == 0
    assert "dtype=bfloat16" in capsys.readouterr().out
    result = json.loads(path.read_text())
    assert result["shape"]["dtype"] == "bfloat16" and result["ran"]
    # the inputs compare makes: bfloat16 (rounded from the same float64 draws as float32 and float16 are)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, n, 4)).astype(ml_dtypes.bfloat16) for n in (20, 28, 28))
    made = cmp.inputs(cmp.Shape(**{**result["shape"], "tiles": None}).resolved())
    for mine, theirs in zip((q, k, v), made):
        assert theirs.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(mine.view(np.uint16), theirs.view(np.uint16))
    # the reference's rule on the exact float32 values of those inputs, as for float16 (the widening is exact)
    base = tolerance.baseline(*(x.astype(np.float32) for x in (q, k, v)), causal=True, block_q=8, block_k=8)
    for row in result["rows"]:
        assert row["passed"]
        assert (row["atol_out"], row["atol_lse"]) == base.tolerances(row["order"])
        assert row["err_out"] <= row["atol_out"]
        model = iomodel.traffic(row["order"], 20, 28, 4, 8, 8, True, heads=2)
        assert row["bytes_model"] == iomodel.to_bytes(model, 2)  # 2 bytes per input element
        if result["machine"]["backend"] == "simulator":
            assert row["bytes_counted"] == row["bytes_model"]


def test_sweep_takes_bfloat16(tmp_path):
    pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes (the test extra)")
    path = tmp_path / "bf16.csv"
    assert cli.main(["sweep", *SWEEP_TINY, "--dtype", "bfloat16", "--causal", "on", "--csv", str(path)]) == 0
    (row,) = list(csv.DictReader(path.open()))
    assert row["passed"] == "True"
    model = iomodel.traffic("v2", 16, 16, 4, 8, 8, True, heads=2)
    assert int(row["bytes_total"]) == iomodel.total_bytes(model, 2)


def test_bfloat16_without_ml_dtypes_is_a_usage_error(monkeypatch, capsys, no_run):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ml_dtypes" else real(name, *a))
    line = _usage_error(["compare", *TINY, "--dtype", "bfloat16"], capsys)
    assert "argument --dtype: bfloat16 needs ml_dtypes" in line


@pytest.mark.parametrize("option", ["--plot", "--tile-map"])
def test_a_plot_without_matplotlib_is_a_usage_error_naming_the_option(option, tmp_path, monkeypatch, capsys, no_run):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    line = _usage_error(["sweep", *SWEEP_TINY, option, str(tmp_path / "out.png")], capsys)
    assert f"argument {option}: --plot and --tile-map need matplotlib" in line


def _subparsers() -> dict:
    top = cli.parser()
    (action,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: action.choices[name] for name in ("compare", "sweep")}


@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_every_option_states_its_default(command):
    sub = _subparsers()[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 15
    for action in options:
        assert action.help and "default" in action.help, f"{action.option_strings[0]} does not state its default"
    text = sub.format_help()
    for rendered in ("default: 20)", "default: 0)", "default: float32)"):  # --repeats, --seed, --dtype
        assert rendered in " ".join(text.split())


def test_sweep_help_states_the_causal_default_and_explains_the_columns(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: off)" in text
    assert "S MiB" in text and "N_q N_k" in text and "dense" in text


def test_every_profile_option_states_its_default():
    from fa_numba import profile

    p = profile.parser()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10
    for action in options:
        assert action.help and "default" in action.help, f"{action.option_strings[0]} does not state its default"
    assert "(default: both)" in " ".join(p.format_help().split())


@pytest.mark.parametrize("argv, option", [
    (["--json", "/no/such/directory/profile.json"], "--json"),
    (["--json", "/"], "--json"),
    (["--batch", "-1"], "--batch"),
    (["--jobs", "0"], "--jobs"),
])
def test_profile_refuses_bad_options_before_compiling(argv, option, capsys, monkeypatch):
    from fa_numba import profile

    monkeypatch.setattr(profile, "profile_configuration", lambda *a: pytest.fail("compiled before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        profile.main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "Traceback" not in captured.err + captured.out
    last = captured.err.rstrip("\n").splitlines()[-1]
    assert last.startswith("fa_numba profile: error: argument ") and option in last, last


def test_compare_decode_checks_counts_and_bounds_each_variant(tmp_path, capsys):
    path = tmp_path / "decode.json"
    code = cli.main(["compare", "--decode", "--n-k", "40", "--heads", "2", "--heads-kv", "1", "--head-dim", "8",
                     "--split-size", "16", "--json", str(path)])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"split", "unsplit", "split-mma", "unsplit-mma", "v2"}
    assert rows["split"]["splits"] == 3 and rows["unsplit"]["splits"] == 1
    assert "float16 and bfloat16" in rows["split-mma"]["skipped"]  # float32: no tensor-core decode kernel
    assert rows["split"]["counted_equals_model"] and rows["unsplit"]["counted_equals_model"]
    model = iomodel.traffic_decode([40], 1, 8, 4, 16, 1, 3, True, 2, 1)
    assert rows["split"]["bytes"] == iomodel.total_bytes(model, 4)
    # the same operations in the same order as compare_decode's (H200's 4.8e12 B/s): bit for bit
    assert rows["split"]["hbm_bound_us"] == rows["split"]["bytes"] / 4.8e12 * 1e6
    out = capsys.readouterr().out
    assert "HBM bound" in out and "not a speed" in out


def test_compare_decode_reports_a_failing_variant_and_exits_1(monkeypatch, capsys):
    from fa_numba import split_kv

    real = split_kv.check

    def wrong(out, *args, **kwargs):  # a kernel result off by 1e-3 everywhere
        return real(out + 1e-3, *args, **kwargs)

    monkeypatch.setattr(split_kv, "check", wrong)
    code = cli.main(["compare", "--decode", "--n-k", "16", "--heads", "1", "--head-dim", "8", "--no-count"])
    assert code == 1
    assert "split FAILED its check" in capsys.readouterr().out
