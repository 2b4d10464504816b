"""fa_numba.sources: the files a kernel build imports, and their digest (the committed SASS table's key)."""

import pathlib

from fa_numba import sources

PACKAGE = pathlib.Path(sources.__file__).resolve().parent


def _names(paths):
    return {str(p.relative_to(PACKAGE)) for p in paths}


def test_the_closure_follows_imports_inside_functions_and_relative_ones():
    """profile imports profile_estimate at module level and the kernels inside its functions (`_build`); every
    module under kernels/ and warp/ is a root; the user API, which no kernel imports, is not a kernel source;
    the kernel digest's closure stops at the performance model, which reads the SASS and changes none."""
    found = _names(sources.closure(sources.KERNEL_ROOTS))
    assert {"profile.py", "profile_estimate.py", "kernels/mma/engine.py", "warp/ptx.py", "backend.py",
            "tiling.py", "tile_counts.py", "machine.py"} <= found
    assert not {"api.py", "cli.py", "dropins.py", "__init__.py"} & found
    kernels = _names(sources.closure(sources.KERNEL_ROOTS, stop=sources.MODEL))
    assert {"profile.py", "kernels/mma/engine.py", "sass.py"} <= kernels  # the build, and reading its SASS
    assert not {"whole_kernel.py", "cycle_model.py", "machine.py", "profile_estimate.py"} & kernels  # the model
    only_tiling = _names(sources.closure(["fa_numba.tiling"]))
    assert only_tiling == {"tiling.py", "tile_counts.py", "shapes.py"}, only_tiling


def test_the_digest_changes_with_one_byte_and_not_with_the_order_or_the_folder(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    first = sources.digest([a, b])
    assert sources.digest([b, a]) == first and len(first) == 16
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "a.py").write_text("x = 1\n")
    (other / "b.py").write_text("y = 2\n")
    assert sources.digest([other / "a.py", other / "b.py"]) == first  # a clone in another folder: same key
    b.write_text("y = 3\n")
    assert sources.digest([a, b]) != first
    assert sources.digest([a]) != first
