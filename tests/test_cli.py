"""`python -m fa_numba compare` on tiny shapes: table, JSON consistent with iomodel, usage errors."""

import json
import subprocess
import sys

import pytest

from fa_numba import cli, iomodel


def test_compare_prints_both_orders_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = cli.main(["compare", "--n-q", "20", "--n-k", "28", "--head-dim", "8", "--block-q", "8",
                     "--block-k", "8", "--causal", "--heads", "2", "--heads-kv", "1", "--json", str(path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "tiled-v1" in text and "tiled-v2" in text and "FAIL" not in text
    result = json.loads(path.read_text())
    assert [r["order"] for r in result["rows"]] == ["v1", "v2"]
    for row in result["rows"]:
        model = iomodel.traffic(row["order"], 20, 28, 8, 8, 8, True, heads=2, heads_kv=1)
        assert row["bytes_model"] == iomodel.to_bytes(model, 4) == row["bytes_counted"]
        assert row["passed"] and row["tiles_computed"] + row["tiles_skipped"] == 2 * 3 * 4


@pytest.mark.parametrize("argv, message", [
    (["compare", "--block-q", "0"], "--block-q: expected a positive integer"),
    (["compare", "--orders", "v3"], "--orders: expected a comma list"),
    (["compare", "--dtype", "int8"], "--dtype: invalid choice"),
    ([], "required: command"),
    (["compare", "--heads", "3", "--heads-kv", "2"], "--heads-kv: 2 must divide --heads (3)"),
])
def test_bad_arguments_exit_2_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "fa_numba", "compare", "--n-q", "16", "--head-dim", "4",
                           "--block-q", "8", "--block-k", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tiled-v2" in done.stdout
