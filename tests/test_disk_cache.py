"""The kernel disk cache (fa_numba.kernels.disk_cache): its key, its invalidation, and its absence where it
would be wrong. A cached kernel is only loaded on a GPU (benchmarks/cache_gpu.py times the first call cold and
warm there); here the key is built with the real numba.cuda in a subprocess (tests/disk_cache_probe.py), which
needs no GPU to make a dispatcher."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from fa_numba import backend
from fa_numba.kernels import disk_cache

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _probe(tmp_path, hash_seed: str) -> dict:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "FA_NUMBA_CACHE_DIR": str(tmp_path), "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, str(HERE / "disk_cache_probe.py")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernel_cache")
    return _probe(folder, "1"), _probe(folder, "2"), folder


def test_the_key_is_the_same_in_every_process_and_tells_configurations_apart(probes):
    """Two processes with other hash seeds give every kernel the same key (numba-cuda's own pickles a device
    function differently in each, so it never finds a closure again); configurations get distinct keys, but for
    one Python function compiled for float32 and float16 (the signature tells those apart)."""
    first, second, _ = probes
    assert first["keys"] == second["keys"]
    by_function = {}
    for cfg, key in first["keys"].items():
        c = json.loads(cfg)
        shared = c["variant"] in ("v2",)  # the CUDA-core kernels: one function, either dtype
        by_function.setdefault(key, set()).add((c["variant"], c["head_dim"], c["causal"],
                                               None if shared else c["dtype"]))
    assert all(len(v) == 1 for v in by_function.values()), by_function


def test_options_numbas_key_leaves_out_are_in_ours(probes):
    plain, capped = probes[0]["index"]
    assert plain != capped and "max_registers" in capped and "max_registers" not in plain


def test_a_users_mod_is_not_cached_and_a_built_in_one_is(probes):
    """numba pickles an importable function by its name: an edit to a user's mod would keep the key, so a kernel
    that closes over one is compiled in each process; a built-in mod is package code, in the digest."""
    found = probes[0]["mods"]
    assert found["user"].startswith("uncacheable: it closes over __main__.user_bias")
    assert len(found["alibi"]) == 64


def test_the_folder_is_the_kernel_sources_digest_and_the_versions(probes):
    folder = pathlib.Path(probes[0]["folder"])
    assert folder.parent == probes[2]
    assert folder.name.startswith(disk_cache.sources.kernel_digest() + "-numba")
    assert f"py{sys.version_info[0]}{sys.version_info[1]}" in folder.name
    assert pathlib.Path(probes[0]["path"]).parent == folder


def test_an_edit_to_a_module_a_kernel_imports_moves_the_cache_to_a_new_folder(tmp_path):
    """A copy of the package with one byte changed in tiling.py (imported by the kernels, not a kernel file):
    `python -m fa_numba cache` names another folder, so nothing compiled before the edit can be found."""
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "fa_numba", copy / "fa_numba", ignore=shutil.ignore_patterns("__pycache__"))

    def folder(tree):
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "FA_NUMBA_CACHE_DIR": str(tmp_path / "cache"),
               "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, "-m", "fa_numba", "cache"], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tree)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if line.startswith("this code's folder: ")][0]

    before = folder(copy)
    tiling = copy / "fa_numba" / "tiling.py"
    tiling.write_text(tiling.read_text() + "\n# an edit\n")
    after = folder(copy)
    assert before != after and before.split("-")[1:] == after.split("-")[1:]  # the digest moved, not the versions


@pytest.mark.skipif(backend.name() != "simulator", reason="the simulator's dispatchers: on a GPU the cache is on")
def test_the_simulator_caches_nothing():
    assert disk_cache.why_off() == "the CUDA simulator compiles nothing" and not disk_cache.enabled()
    kernel = disk_cache.jit(lambda x: None)
    assert not hasattr(kernel, "_cache")


def test_the_cache_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("FA_NUMBA_CACHE", "0")
    assert disk_cache.why_off() == "FA_NUMBA_CACHE=0"


def test_the_cli_reports_and_clears_the_folder(tmp_path, monkeypatch, capsys):
    from fa_numba import cli

    monkeypatch.setenv("FA_NUMBA_CACHE_DIR", str(tmp_path))
    (tmp_path / "gen" / "kernels_x").mkdir(parents=True)
    (tmp_path / "gen" / "kernels_x" / "v2.nbc").write_bytes(b"0" * 2048)
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"kernel cache: {tmp_path} (1 files, 0.0 MiB)" in out and "caching: " in out
    assert cli.main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 1 files from {tmp_path}"
    assert not tmp_path.exists()


def test_every_kernel_factory_compiles_through_the_cache():
    """No kernel is made by numba.cuda.jit directly (device functions aside): each goes through disk_cache.jit."""
    package = ROOT / "fa_numba"
    direct = [f"{p.relative_to(ROOT)}:{n}" for p in package.rglob("*.py") if p.name != "disk_cache.py"
              for n, line in enumerate(p.read_text().splitlines(), 1)
              if ("cuda.jit(" in line or line.strip() == "@cuda.jit") and "device=True" not in line
              and not line.lstrip().startswith(("#", '"', "'")) and "`" not in line]
    assert direct == [], direct
