"""Compiled kernels kept on disk, so a new process launches what an earlier one compiled.

`jit(fn, **options)` is `numba.cuda.jit(fn, **options)` with numba-cuda's on-disk cache pointed at a folder
of this package's own and keyed by everything that decides the binary:

- the folder: `cache_root()` / (the digest of every source a kernel build imports, `sources.kernel_digest`;
  the versions of numba, numba-cuda, llvmlite, NumPy and Python): an edit anywhere in the kernels, the warp primitives or a
  module they import starts a new folder, so a stale binary is never found, whichever file changed;
- inside it, numba-cuda's index file per function, keyed by the signature, the CUDA runtime version and
  compute capability, the kernel's `fingerprint` (its bytecode and closure cells, followed into the device
  functions it closes over: the tiles, dtypes and flags a factory closes over) and the compile options
  (`max_registers`: one function compiled with and without a register cap is two entries).

What is not cached: a kernel that closes over a function from outside the package (a user's score mod or
mask_mod; numba pickles an importable function by name, so an edit to it would not change the key), any
kernel under the CUDA simulator (it compiles nothing), and every kernel when FA_NUMBA_CACHE=0. A cache entry
that cannot be read or written costs a compile, never a launch: any error in the cache is a warning once,
then the kernel compiles as without it.

Where: $FA_NUMBA_CACHE_DIR, else $XDG_CACHE_HOME/fa_numba/kernels, else ~/.cache/fa_numba/kernels.
`python -m fa_numba cache` prints the folder and its size; `python -m fa_numba cache --clear` removes it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import sys
import types
import warnings

import numpy as np
from numba import cuda

from fa_numba import backend, sources

PACKAGE = "fa_numba"
# modules whose functions a kernel may close over without them being part of the key's digest: their
# versions are in the folder's name (numba, numba-cuda, llvmlite, NumPy) or they are the standard library's
_KNOWN = ("fa_numba", "numba", "numba_cuda", "llvmlite", "math", "cmath", "numpy", "operator", "builtins")


def why_off() -> str | None:
    """Why kernels are not cached on disk in this process, or None when they are (on a GPU, by default)."""
    if os.environ.get("FA_NUMBA_CACHE", "1") == "0":
        return "FA_NUMBA_CACHE=0"
    if backend.name() != "gpu":
        return "the CUDA simulator compiles nothing"
    if _WARNED:
        return _WARNED[0]
    return None


def enabled() -> bool:
    return why_off() is None


def cache_root() -> pathlib.Path:
    """The folder every cache generation lives in (module docstring)."""
    if os.environ.get("FA_NUMBA_CACHE_DIR"):
        return pathlib.Path(os.environ["FA_NUMBA_CACHE_DIR"])
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "fa_numba" / "kernels"


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=None)
def generation() -> str:
    """The name of this code's folder: the kernel sources' digest; numba's, numba-cuda's, llvmlite's, NumPy's
    and Python's versions."""
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    versions = "-".join(f"{name}{_version(name)}" for name in ("numba", "numba-cuda", "llvmlite", "numpy"))
    return f"{sources.kernel_digest()}-{versions}-{python}"


def cache_dir() -> pathlib.Path:
    return cache_root() / generation()


class Uncacheable(TypeError):
    """A kernel whose closure holds something without a stable fingerprint (or a user's function)."""


def _code(code: types.CodeType) -> tuple:
    """A code object by its bytecode, names and constants (nested code objects the same way)."""
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return ("code", code.co_qualname if hasattr(code, "co_qualname") else code.co_name, code.co_code,
            code.co_names, code.co_varnames, code.co_freevars, consts)


def fingerprint(obj, seen: tuple = ()) -> tuple:
    """A value that identifies obj across processes: a function by its module, bytecode and closure cells
    (recursively), a dispatcher by its Python function and options, containers and dataclasses by their
    items, NumPy arrays by dtype, shape and bytes, scalars, strings, dtypes and Numba types by repr.
    numba-cuda's own key pickles the cells, which differs from one process to the next for a dispatcher (its
    pickle follows set and dict order under hash randomisation), so a closure over a device function would
    never be found again. A function from outside the package (a user's mod: numba pickles it by name, so
    an edit would keep its key) or an object of another kind is Uncacheable."""
    if any(obj is s for s in seen):
        return ("cycle",)
    seen = seen + (obj,)
    if isinstance(obj, types.FunctionType):
        module = getattr(obj, "__module__", None) or ""
        if module.split(".")[0] not in _KNOWN:
            raise Uncacheable(f"it closes over {module}.{obj.__qualname__}, a function from outside fa_numba")
        cells = tuple(fingerprint(_cell(c), seen) for c in obj.__closure__ or ())
        defaults = fingerprint(obj.__defaults__, seen)
        return ("function", module, obj.__qualname__, _code(obj.__code__), cells, defaults)
    defn = getattr(obj, "_defn", None)
    if isinstance(defn, types.FunctionType) and hasattr(obj, "_name"):  # a numba @intrinsic (inline PTX)
        return ("intrinsic", obj._name, fingerprint(defn, seen))
    py_func = getattr(obj, "py_func", None)
    if isinstance(py_func, types.FunctionType):  # a numba dispatcher (a device function)
        options = tuple(sorted((k, repr(v)) for k, v in getattr(obj, "targetoptions", {}).items()))
        return ("dispatcher", type(obj).__name__, fingerprint(py_func, seen), options)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return (type(obj).__name__, repr(obj))
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, types.ModuleType):  # its code: the digest (fa_numba) or the versions in the folder's name
        if obj.__name__.split(".")[0] not in _KNOWN:
            raise Uncacheable(f"it closes over the module {obj.__name__}, from outside fa_numba")
        return ("module", obj.__name__)
    if isinstance(obj, (np.generic, np.dtype, type)) or type(obj).__module__.split(".")[0] in ("numba", "llvmlite"):
        text = repr(obj)  # a dtype, a Numba type, an LLVM type: their repr is their value
        if " at 0x" in text or "object at" in text:
            raise Uncacheable(f"it closes over {text}, whose repr is an address")
        return (type(obj).__qualname__, text)
    if dataclasses.is_dataclass(obj):
        return ("dataclass", type(obj).__qualname__,
                tuple((f.name, fingerprint(getattr(obj, f.name), seen)) for f in dataclasses.fields(obj)))
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(fingerprint(x, seen) for x in obj))
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, tuple(sorted(repr(fingerprint(x, seen)) for x in obj)))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((repr(k), repr(fingerprint(v, seen))) for k, v in obj.items())))
    if isinstance(obj, functools.partial):
        return ("partial", fingerprint(obj.func, seen), fingerprint(obj.args, seen), fingerprint(obj.keywords, seen))
    if type(obj).__module__.split(".")[0] in ("fa_numba",) and hasattr(obj, "__dict__"):
        return ("object", type(obj).__qualname__,
                tuple(sorted((k, repr(fingerprint(v, seen))) for k, v in vars(obj).items())))
    raise Uncacheable(f"it closes over a {type(obj).__module__}.{type(obj).__qualname__}, which has no fingerprint")


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def kernel_key(fn) -> str:
    """sha256 of fn's fingerprint (hex): what tells one kernel's binaries from another's in the cache."""
    return hashlib.sha256(repr(fingerprint(fn)).encode()).hexdigest()


_WARNED: list = []


def _warn_once(message: str) -> None:
    if not _WARNED:
        _WARNED.append(message)
        warnings.warn(f"fa_numba's kernel cache is off for this process: {message}", RuntimeWarning, stacklevel=3)


def jit(fn, **options):
    """numba.cuda.jit(fn, **options), its binaries kept on disk when `enabled()` (module docstring)."""
    dispatcher = cuda.jit(fn, **options)
    if not enabled():
        return dispatcher
    try:
        key = kernel_key(fn)
    except Uncacheable:  # a user's mod, or a closure we cannot fingerprint: compiled in each process
        return dispatcher
    try:
        dispatcher._cache = _cache_class()(fn, key, tuple(sorted((k, repr(v)) for k, v in options.items())))
    except Exception as err:  # noqa: BLE001 - numba-cuda's cache internals vary by version
        _warn_once(f"{type(err).__name__}: {err}")
    return dispatcher


@functools.lru_cache(maxsize=None)
def _cache_class():
    """numba-cuda's CUDACache with this module's folder and the options in the key; every error it meets
    turns into a compile (and one warning) instead of failing a launch."""
    from numba.cuda.core import caching
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class Locator(caching._UserProvidedCacheLocator):
        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(cache_dir() / self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            return caching._SourceFileBackedLocatorMixin.from_function.__func__(cls, py_func, py_file)

        def get_source_stamp(self):
            return generation()  # the folder is already per source digest: mtimes would only miss

    class Impl(CUDACacheImpl):
        _locator_classes = [Locator]

    class KernelCache(CUDACache):
        _impl_class = Impl

        def __init__(self, py_func, key, options):
            self._key, self._options = key, options
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            # numba-cuda's key hashes the pickled closure cells, which differ between processes: ours is the
            # fingerprint's, with the options numba's key leaves out
            return (sig, codegen.magic_tuple(), self._key, self._options)

        def load_overload(self, sig, target_context):
            try:
                return super().load_overload(sig, target_context)
            except Exception as err:  # noqa: BLE001 - a cache we cannot read is a compile
                _warn_once(f"reading it failed ({type(err).__name__}: {err})")
                self.disable()
                return None

        def save_overload(self, sig, data):
            try:
                super().save_overload(sig, data)
            except Exception as err:  # noqa: BLE001 - a cache we cannot write costs the next process a compile
                _warn_once(f"writing it failed ({type(err).__name__}: {err})")
                self.disable()

    return KernelCache


def size() -> tuple[int, int]:
    """(files, bytes) under cache_root()."""
    root = cache_root()
    files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def clear() -> int:
    """Remove cache_root() and everything in it; returns the files removed."""
    import shutil

    count, _ = size()
    if cache_root().is_dir():
        shutil.rmtree(cache_root())
    return count
