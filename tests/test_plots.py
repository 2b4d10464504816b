"""The pictures `sweep --plot` and `--tile-map` draw (fa_numba.plots), judged on the saved figure objects:
identical series drawn once under both names, the swept N as tick labels, titles inside the figure."""

import json

import numpy as np
import pytest

from fa_numba import cli, masks, plots, tiling

pytest.importorskip("matplotlib", reason="plots need the optional 'plot' extra (matplotlib)")

LONG_LABEL = "causal (for reference: this sweep ran unmasked, every tile FULL)"  # what --causal off titles


@pytest.fixture
def saved(monkeypatch):
    """Every figure saved while the test runs (plots closes its figures; the objects stay readable)."""
    from matplotlib.figure import Figure

    figures, real = [], Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


def _rows(ns, bytes_of, timed=False):
    """Sweep rows as cli builds them, with bytes given per variant (two pairs share their bytes, as v1 and
    v1-rowwise do: the same loop order moves the same bytes)."""
    rows = []
    for n in ns:
        for variant, total in bytes_of(n).items():
            rows.append({"n": n, "head_dim": 16, "causal": False, "mask": None, "variant": variant,
                         "bytes_total": total, "scores_bytes": 2 * n * n * 4,
                         "dense_bytes": 2 * (4 * n * n + 64 * n) * 4,
                         "median_ms": (0.01 * n * (2 if variant.startswith("v1") else 1)) if timed else None})
    return rows


def _pairs(n):
    return {"v1": 100 * n, "v1-rowwise": 100 * n, "v2": 30 * n, "v2-rowwise": 30 * n}


def _titles(fig):
    """Every non-empty title of the figure: the figure's own and each axes' three."""
    texts = list(fig.texts) + [getattr(fig, "_suptitle", None)]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title]
    return [t for t in texts if t is not None and t.get_text().strip()]


def _inside(fig, text) -> bool:
    """Whether text lies inside the figure as drawn (a closed figure gets a fresh Agg canvas to draw on)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = text.get_window_extent(canvas.get_renderer())
    frame = fig.bbox
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


def test_identical_series_are_drawn_once_under_both_names(tmp_path, saved):
    plots.traffic_vs_n(_rows([64, 256, 1024], _pairs), str(tmp_path / "t.png"))
    (fig,) = saved
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels.count("v1, v1-rowwise d=16") == 1 and labels.count("v2, v2-rowwise d=16") == 1
    assert not {"v1 d=16", "v1-rowwise d=16", "v2 d=16", "v2-rowwise d=16"} & set(labels)
    assert len(labels) == 4  # two merged series and the two dense references
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "v1, v1-rowwise d=16" in legend and "v2, v2-rowwise d=16" in legend
    merged = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert merged["v1, v1-rowwise d=16"] == [100 * n for n in (64, 256, 1024)]


def test_series_that_differ_are_not_merged(tmp_path, saved):
    def differ(n):
        return {"v1": 100 * n, "v1-rowwise": 100 * n + 1, "v2": 30 * n, "v2-rowwise": 30 * n}

    plots.traffic_vs_n(_rows([64, 256], differ), str(tmp_path / "t.png"))
    labels = [line.get_label() for line in saved[0].axes[0].get_lines()]
    assert "v1 d=16" in labels and "v1-rowwise d=16" in labels and "v2, v2-rowwise d=16" in labels


@pytest.mark.parametrize("timed", [False, True])
def test_the_swept_n_are_the_x_tick_labels(timed, tmp_path, saved):
    ns = [64, 100, 256, 1024, 3000]
    plots.traffic_vs_n(_rows(ns, _pairs, timed=timed), str(tmp_path / "t.png"))
    (fig,) = saved
    assert len(fig.axes) == (2 if timed else 1)
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        shown = [t.get_text() for t in ax.get_xticklabels()]
        assert shown == [str(n) for n in ns]
        assert not any(t.get_text() for t in ax.get_xticklabels(minor=True))  # no 10^x labels among them


@pytest.mark.parametrize("n, tiles, label", [
    (32, (4, 8), LONG_LABEL),  # 8 x 4 tiles: the smallest figure, the longest title
    (32, (8, 8), "mask documents-causal(4, 4, 4, 4, 4, 4, 4, 4) and a label long enough to need wrapping twice"),
    (640, (16, 16), LONG_LABEL),  # 40 x 40 tiles: the largest figure
])
def test_the_tile_map_title_fits_in_the_figure(n, tiles, label, tmp_path, saved):
    kinds = tiling.classify(n, n, *tiles, mask=masks.causal())
    plots.tile_map(kinds, n, n, *tiles, str(tmp_path / "tiles.png"), label=label)
    (fig,) = saved
    titles = _titles(fig)
    assert titles
    for title in titles:
        assert _inside(fig, title), f"title {title.get_text()!r} is cut by the figure's edge"
    words = " ".join(" ".join(t.get_text() for t in titles).split())
    assert f"{label} tiles, N_q={n}, N_k={n}" in words  # wrapped, never shortened
    counts = [int((kinds == k).sum()) for k in (tiling.SKIP, tiling.FULL, tiling.PARTIAL)]
    assert f"{counts[0]} skipped, {counts[1]} full, {counts[2]} partial" in words


def test_sweep_draws_merged_series_ticks_and_a_fitting_title(tmp_path, saved):
    """End to end: an unmasked sweep of every variant, its traffic plot and (causal, for reference) tile map."""
    plot, tile_map, rows = tmp_path / "traffic.png", tmp_path / "tiles.png", tmp_path / "rows.json"
    assert cli.main(["sweep", "--n", "16,32", "--head-dims", "4", "--block-q", "4", "--block-k", "8", "--no-count",
                     "--plot", str(plot), "--tile-map", str(tile_map), "--json", str(rows)]) == 0
    traffic, tiles = saved
    by_variant = {}
    for r in json.loads(rows.read_text())["rows"]:
        by_variant.setdefault(r["variant"], []).append(r["bytes_total"])
    assert by_variant["v1"] == by_variant["v1-rowwise"] != by_variant["v2"] == by_variant["v2-rowwise"]
    labels = [line.get_label() for line in traffic.axes[0].get_lines()]
    assert "v1, v1-rowwise d=4" in labels and "v2, v2-rowwise d=4" in labels and len(labels) == 4
    assert [t.get_text() for t in traffic.axes[0].get_xticklabels()] == ["16", "32"]
    for title in _titles(tiles):
        assert _inside(tiles, title)
    assert LONG_LABEL in " ".join(" ".join(t.get_text() for t in _titles(tiles)).split())
    for png in (plot, tile_map):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
