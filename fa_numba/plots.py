"""Pictures for `sweep` (needs matplotlib: the `plot` extra). Everything drawn is computed by fa_numba."""

from __future__ import annotations

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


def traffic_vs_n(rows: list[dict], path: str) -> None:
    """HBM bytes vs N for each variant (analytic, log-log), with the N^2 bytes of a materialised S;
    and, when the rows carry GPU times, a second panel of time vs N."""
    plt = _pyplot()
    timed = any(r.get("median_ms") for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    groups = sorted({_group(r) for r in rows})
    for group in groups:
        sel = sorted((r for r in rows if _group(r) == group), key=lambda r: r["n"])
        ax.plot([r["n"] for r in sel], [r["bytes_total"] for r in sel], marker="o", label=_group_label(*group))
    ns = sorted({r["n"] for r in rows})
    scores = {r["n"]: r["scores_bytes"] for r in rows}
    dense = {}
    for r in rows:  # the largest head dim's dense traffic (its N^2 part does not depend on d)
        dense[r["n"]] = max(dense.get(r["n"], 0), r["dense_bytes"])
    ax.plot(ns, [dense[n] for n in ns], "k--", label="dense attention, S and P in HBM (4 N^2)")
    ax.plot(ns, [scores[n] for n in ns], "k:", label="size of S alone (N^2, float32)")
    ax.set(xscale="log", yscale="log", xlabel="N (= N_q = N_k)", ylabel="HBM bytes (iomodel)",
           title="HBM traffic vs N")
    ax.legend(fontsize=8)
    if timed:
        ax = axes[0][1]
        for group in groups:
            sel = sorted((r for r in rows if _group(r) == group and r.get("median_ms")), key=lambda r: r["n"])
            ax.plot([r["n"] for r in sel], [r["median_ms"] for r in sel], marker="o", label=_group_label(*group))
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="median ms (CUDA events)", title="time vs N")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    ax.set(xlabel=f"key tile j (B_c = {block_k})", ylabel=f"query tile i (B_r = {block_q})",
           title=f"{label} tiles, N_q={n_q}, N_k={n_k}\n"
                 f"{(kinds == 0).sum()} skipped, {(kinds == 1).sum()} full, {(kinds == 2).sum()} partial")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=[Patch(color=c, label=l) for c, l in zip(colors, ["SKIP", "FULL", "PARTIAL"])],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
