"""Write the three notebooks from the cell sources below and execute them in place (outputs stored).

    python notebooks_optional/build.py          # needs the `notebooks` extra

The notebooks only import fa_numba and plot what it computes; this file is their source of truth, and
tests/test_notebooks.py executes the stored notebooks again.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """\
import numpy as np
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
%matplotlib inline
import fa_numba
print("backend:", fa_numba.backend.name())"""

ONLINE_SOFTMAX = [
    ("markdown", """\
# 1. Online softmax

The state of a set of scores is $(m, \\ell, \\mathrm{acc})$: the maximum, the sum of $e^{s-m}$ and the
weighted sum of values (proofs/L2_online_softmax.md). Two states merge exactly, in any order. Here are the
lecture's worked examples, computed with `fa_numba.online_softmax`, then a random row split into random
blocks and merged in random orders."""),
    ("code", SETUP + "\nfrom fa_numba import online_softmax as osm\n\n"
     "def state(scores, values=None):\n"
     "    s = np.asarray([scores], dtype=np.float64)\n"
     "    v = np.ones((s.shape[1], 1)) if values is None else np.asarray(values, dtype=np.float64)\n"
     "    return osm.from_block(s, v)"),
    ("markdown", "**The max shift.** $[1, 2, 3, 5]$ has $m = 5$; the shifted row is $[-4, -3, -2, 0]$ and every exponent is $\\le 0$."),
    ("code", """\
x = np.array([1.0, 2.0, 3.0, 5.0])
st = state(x)
print("shifted:", (x - st.m[0]).tolist(), " m =", st.m[0], " l =", st.l[0])
assert (x - st.m[0]).tolist() == [-4.0, -3.0, -2.0, 0.0]"""),
    ("markdown", "**Two blocks.** $[1, 2]$ and $[3, 5]$ each know only their own max; merging rescales the left block by $e^{2-5}$."),
    ("code", """\
left, right = state([1.0, 2.0]), state([3.0, 5.0])
merged = osm.merge(left, right)
print(f"left  m={left.m[0]} l={left.l[0]:.6f}")
print(f"right m={right.m[0]} l={right.l[0]:.6f}")
print(f"merged m={merged.m[0]} l={merged.l[0]:.6f} = e^(2-5) * {left.l[0]:.6f} + {right.l[0]:.6f}")
assert np.isclose(merged.l[0], state(x).l[0], rtol=1e-15)"""),
    ("markdown", "**A score arrives.** After $[1, 2]$, the score $3$ raises the max: $\\ell' = e^{-1}(e^{-1} + 1) + 1$."),
    ("code", """\
after = osm.update(state([1.0, 2.0]), np.array([[3.0]]), np.ones((1, 1)))
print(after.m[0], after.l[0], np.exp(-1) * (np.exp(-1) + 1) + 1)
out, lse = osm.finalize(after)
print("LSE:", lse[0], "=", np.log(np.exp(1) + np.exp(2) + np.exp(3)))"""),
    ("markdown", """\
**Any split, any order.** A row of 4096 scores (logits up to about 30) with values of width 8, cut into random
blocks and merged in random orders and bracketings. The error against the float64 softmax stays at
the level of float64 rounding whatever the order; in float32 it stays at float32 rounding."""),
    ("code", """\
from scipy.special import softmax, logsumexp
rng = np.random.default_rng(0)
n, d = 4096, 8
scores = rng.standard_normal((1, n)) * 10
values = rng.standard_normal((n, d))
exact_out = softmax(scores[0]) @ values
exact_lse = logsumexp(scores[0])

def random_merge(dtype, trial):
    g = np.random.default_rng(trial)
    cuts = np.sort(g.choice(np.arange(1, n), size=g.integers(1, 200), replace=False))
    bounds = [0, *cuts, n]
    states = [osm.from_block(scores[:, a:b].astype(dtype), values[a:b].astype(dtype)) for a, b in zip(bounds, bounds[1:])]
    while len(states) > 1:  # merge two random states: a random bracketing and order
        i, j = g.choice(len(states), size=2, replace=False)
        merged = osm.merge(states[i], states[j])
        states = [s for k, s in enumerate(states) if k not in (i, j)] + [merged]
    out, lse = osm.finalize(states[0])
    return len(bounds) - 1, np.abs(out[0] - exact_out).max(), abs(lse[0] - exact_lse)

results = {dt: np.array([random_merge(dt, t) for t in range(60)]) for dt in (np.float64, np.float32)}
fig, ax = plt.subplots(figsize=(6, 4))
for dt, marker in ((np.float64, "o"), (np.float32, "s")):
    r = results[dt]
    ax.scatter(r[:, 0], r[:, 1], marker=marker, label=f"{dt.__name__}: max |O - softmax(s) V|")
ax.set(xscale="log", yscale="log", xlabel="number of blocks", ylabel="error vs float64 softmax",
       title="random splits, random merge orders")
ax.legend()
plt.show()
print("largest float64 error:", results[np.float64][:, 1].max(), " largest float32 error:", results[np.float32][:, 1].max())
assert results[np.float64][:, 1].max() < 1e-13 and results[np.float32][:, 1].max() < 1e-5"""),
]

TILES = [
    ("markdown", """\
# 2. Tiles and causal skipping

`fa_numba.tiling.classify` labels every (query tile, key tile) pair SKIP (every key in the future: never
loaded), FULL (no mask needed) or PARTIAL (masked inside), for bottom-right causal alignment:
query $i$ sees key $j$ iff $j \\le i + N_k - N_q$ (proofs/L3_causal_tiles.md)."""),
    ("code", SETUP + """
from fa_numba import tiling
from matplotlib.colors import ListedColormap

def draw(ax, n_q, n_k, bq, bk):
    kinds = tiling.classify(n_q, n_k, bq, bk, causal=True)
    ax.imshow(kinds, cmap=ListedColormap(["#eeeeee", "#3b7dd8", "#f0a030"]), vmin=0, vmax=2)
    ax.set(title=f"N_q={n_q}, N_k={n_k}, tiles {bq}x{bk}\\nSKIP {(kinds == 0).sum()}, FULL {(kinds == 1).sum()}, PARTIAL {(kinds == 2).sum()}",
           xlabel="key tile j", ylabel="query tile i")
    return kinds"""),
    ("markdown", "Square, more keys than queries (decoding with a cache), and more queries than keys (whole query tiles see nothing). Grey SKIP, blue FULL, orange PARTIAL."),
    ("code", """\
fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
square = draw(axes[0], 128, 128, 16, 16)
wide = draw(axes[1], 64, 160, 16, 16)
tall = draw(axes[2], 160, 64, 16, 16)
plt.tight_layout(); plt.show()
assert (tall[:6] == 0).all()  # queries 0..95 see no key: six query tiles skipped whole"""),
    ("markdown", "**Fraction of tiles skipped vs N** (square, tiles of 64): it tends to one half, the price of the diagonal tiles fading as $1/T$."),
    ("code", """\
ns = [64 * t for t in (1, 2, 4, 8, 16, 32, 64, 128)]
frac = [(tiling.classify(n, n, 64, 64, causal=True) == tiling.SKIP).mean() for n in ns]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(ns, frac, marker="o"); ax.axhline(0.5, color="k", ls=":")
ax.set(xscale="log", xlabel="N", ylabel="fraction of tiles skipped", title="causal, B_r = B_c = 64")
plt.show()
for n, f in zip(ns, frac):
    t = n // 64
    assert abs(f - (t - 1) / (2 * t)) < 1e-12  # T(T-1)/2 skipped of T^2 tiles
    print(f"N = {n}: {f:.4f} skipped = (T - 1) / (2T) with T = {t}")"""),
    ("markdown", "**Visit order.** The same tiles, numbered in the order each schedule visits them: v1 walks down key-tile columns (K/V outer), v2 along query-tile rows (Q outer)."),
    ("code", """\
fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
for ax, order in zip(axes, ("v1", "v2")):
    sched = tiling.schedule(order, 96, 96, 16, 16, causal=True)
    grid = np.full(sched.kinds.shape, np.nan)
    for step, (i, j, kind) in enumerate(sched.visits):
        grid[i, j] = step
        ax.text(j, i, step, ha="center", va="center", fontsize=8)
    ax.imshow(grid, cmap="viridis")
    ax.set(title=f"{order}: {sched.computed} visits, {sched.skipped} skipped, {sched.masked} masked",
           xlabel="key tile j", ylabel="query tile i")
plt.tight_layout(); plt.show()"""),
]

V1_V2 = [
    ("markdown", """\
# 3. v1 vs v2

Both kernels on the same inputs (`fa_numba.compare`): their check against the float64 reference, tiles,
and HBM bytes, modelled by `iomodel` and, in the simulator, counted element by element. Without a GPU this
runs in Numba's CUDA simulator on a small shape; on a GPU it also times both."""),
    ("code", SETUP + "\nfrom fa_numba import compare, iomodel\nimport pathlib"),
    ("code", """\
shape = compare.Shape(batch=1, heads=2, n_q=48, head_dim=8, causal=True, block_q=16, block_k=16)
result = compare.run(shape)
print(compare.render(result))
assert compare.all_passed(result)"""),
    ("markdown", """\
**HBM traffic vs N** (analytic, both orders, $d = 64$, tiles of 64, float32) against the $4N^2$ elements that
dense attention moves when it writes S and P to HBM and reads them back (proofs/L5_hbm_traffic.md)."""),
    ("code", """\
ns = [256, 512, 1024, 2048, 4096, 8192]
fig, ax = plt.subplots(figsize=(6.5, 4.5))
for order in ("v1", "v2"):
    for causal, ls in ((False, "-"), (True, "--")):
        ax.plot(ns, [iomodel.total_bytes(iomodel.traffic(order, n, n, 64, 64, 64, causal), 4) for n in ns],
                ls, marker="o", label=f"{order}{' causal' if causal else ''}")
ax.plot(ns, [iomodel.dense_traffic_elements(n, n, 64) * 4 for n in ns], "k:", label="dense: S and P in HBM")
ax.set(xscale="log", yscale="log", xlabel="N", ylabel="bytes", title="HBM traffic, one head, d = 64")
ax.legend(); plt.show()"""),
    ("markdown", "**Measured on a GPU.** The table `benchmarks/compare_gpu.py` committed under `benchmarks/results/`, if one exists."),
    ("code", """\
root = pathlib.Path(fa_numba.__file__).resolve().parents[1]
found = sorted((root / "benchmarks" / "results").glob("*.md")) if (root / "benchmarks" / "results").exists() else []
if found:
    for path in found:
        print(path.name); print(path.read_text())
else:
    print("No GPU results committed yet: no GPU has been lent to this project so far.")"""),
]


def notebook(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    return nb


NOTEBOOKS = {
    "01_online_softmax.ipynb": ONLINE_SOFTMAX,
    "02_tiles_and_causal_skipping.ipynb": TILES,
    "03_v1_vs_v2.ipynb": V1_V2,
}


def main() -> int:
    for name, cells in NOTEBOOKS.items():
        nb = notebook(cells)
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, HERE / name)
        print("wrote", name, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
