"""Pictures for `sweep` (needs matplotlib: the `plot` extra). Everything drawn is computed by fa_numba."""

from __future__ import annotations

import textwrap

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _group(row: dict) -> tuple:
    """One line of a plot: variant, head dim, causal, mask ("" for none; rows from before masks have no key)."""
    return row["variant"], row["head_dim"], row["causal"], row.get("mask") or ""


def _group_label(variant: str, d: int, causal: bool, mask: str) -> str:
    return f"{variant} d={d}{' causal' if causal else ''}{' ' + mask if mask else ''}"


def _n_ticks(ax, ns: list[int]) -> None:
    """The swept N as the log axis' tick labels (a log axis labels only powers of 10, often none of them)."""
    from matplotlib.ticker import FixedLocator, FixedFormatter, NullFormatter

    ax.xaxis.set_major_locator(FixedLocator(ns))
    ax.xaxis.set_major_formatter(FixedFormatter([str(n) for n in ns]))
    ax.xaxis.set_minor_formatter(NullFormatter())  # the minor ticks stay, unlabelled
    if len(ns) > 6:  # many sizes: slanted labels do not overlap
        ax.tick_params(axis="x", labelrotation=45)


def _bytes_series(rows: list[dict]) -> list[tuple[str, list[int], list[int]]]:
    """(label, N, bytes) per line of the traffic plot. Variants whose points are identical (v1 and
    v1-rowwise share a loop order, so their bytes) are one line labelled with every name ("v1, v1-rowwise
    d=64"): drawn twice, the second would hide the first."""
    merged: dict[tuple, list[str]] = {}
    for variant, d, causal, mask in sorted({_group(r) for r in rows}):
        sel = sorted((r for r in rows if _group(r) == (variant, d, causal, mask)), key=lambda r: r["n"])
        points = (tuple(r["n"] for r in sel), tuple(r["bytes_total"] for r in sel))
        merged.setdefault((d, causal, mask, points), []).append(variant)
    return [(_group_label(", ".join(names), d, causal, mask), list(ns), list(ys))
            for (d, causal, mask, (ns, ys)), names in merged.items()]


def traffic_vs_n(rows: list[dict], path: str) -> None:
    """HBM bytes vs N for each variant (analytic, log-log; identical series drawn once under all their
    names), with the N^2 bytes of a materialised S; and, when the rows carry GPU times, a second panel of
    time vs N. The swept N label the x axis."""
    plt = _pyplot()
    timed = any(r.get("median_ms") for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    groups = sorted({_group(r) for r in rows})
    for label, ns, ys in _bytes_series(rows):
        ax.plot(ns, ys, marker="o", label=label)
    ns = sorted({r["n"] for r in rows})
    scores = {r["n"]: r["scores_bytes"] for r in rows}
    dense = {}
    for r in rows:  # the largest head dim's dense traffic (its N^2 part does not depend on d)
        dense[r["n"]] = max(dense.get(r["n"], 0), r["dense_bytes"])
    ax.plot(ns, [dense[n] for n in ns], "k--", label="dense attention, S and P in HBM (4 N^2)")
    ax.plot(ns, [scores[n] for n in ns], "k:", label="size of S alone (N^2, float32)")
    ax.set(xscale="log", yscale="log", xlabel="N (= N_q = N_k)", ylabel="HBM bytes (iomodel)",
           title="HBM traffic vs N")
    _n_ticks(ax, ns)
    ax.legend(fontsize=8)
    if timed:
        ax = axes[0][1]
        for group in groups:
            sel = sorted((r for r in rows if _group(r) == group and r.get("median_ms")), key=lambda r: r["n"])
            ax.plot([r["n"] for r in sel], [r["median_ms"] for r in sel], marker="o", label=_group_label(*group))
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="median ms (CUDA events)", title="time vs N")
        _n_ticks(ax, ns)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fit_title(fig, ax, lines: list[str]) -> None:
    """ax's title, its lines wrapped (never shortened) until the title lies inside the figure: it is centred on
    the axes, which the y label pushes right, and a long mask label is wider than a small grid's figure."""
    title = ax.set_title("\n".join(lines))
    width = max(len(line) for line in lines)
    while True:
        fig.tight_layout()  # the layout the file gets, with this title's height
        fig.canvas.draw()  # measure the title where it will be drawn
        box, frame = title.get_window_extent(fig.canvas.get_renderer()), fig.bbox
        if (frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1) or width <= 10:
            return
        width -= max(1, width // 10)
        title.set_text("\n".join(textwrap.fill(line, width) for line in lines))


def tile_map(kinds: np.ndarray, n_q: int, n_k: int, block_q: int, block_k: int, path: str,
             label: str = "causal") -> None:
    """The T_r x T_c classification (tiling.classify) of a mask: SKIP (never loaded), FULL (no mask),
    PARTIAL (masked inside). label names the mask in the title ("causal", "mask window(8, 0)", ...)."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = ["#eeeeee", "#3b7dd8", "#f0a030"]  # SKIP, FULL, PARTIAL (tiling.Kind order)
    t_r, t_c = kinds.shape
    fig, ax = plt.subplots(figsize=(min(10, max(5, 2 + 0.35 * t_c)), min(10, max(5, 2 + 0.35 * t_r))))
    ax.imshow(kinds, cmap=ListedColormap(colors), vmin=0, vmax=2, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, t_c, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, t_r, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set(xlabel=f"key tile j (B_c = {block_k})", ylabel=f"query tile i (B_r = {block_q})")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=[Patch(color=c, label=l) for c, l in zip(colors, ["SKIP", "FULL", "PARTIAL"])],
              loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)  # beside the grid: it hid tiles
    _fit_title(fig, ax, [f"{label} tiles, N_q={n_q}, N_k={n_k}",
                         f"{(kinds == 0).sum()} skipped, {(kinds == 1).sum()} full, {(kinds == 2).sum()} partial"])
    fig.savefig(path, dpi=120)
    plt.close(fig)
