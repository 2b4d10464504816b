"""Which source files decide a compiled kernel, and one digest of them.

A compiled kernel (its SASS, registers, shared memory) and everything derived from it offline (the committed
SASS table, traced wavefronts) is a function of the code the compile imports. `closure` follows the package's
imports statically (every `import` and `from ... import` of `fa_numba`, at module level or inside a function)
from a few root modules, so a module added later is covered without a list to keep; `digest` hashes those
files' names and bytes. The performance model's modules (`MODEL`) read the SASS and change no binary: they
are left out, so an edit to the model keeps the key (the committed SASS table's figures derived by the
model, its counts and hot-loop bound, are then the previous model's until the table is made again). The top-level `fa_numba/__init__.py` only re-exports the user API and is left out.
"""

from __future__ import annotations

import ast
import hashlib
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent
TOP = PACKAGE.name  # "fa_numba"


def _file_of(module: str) -> pathlib.Path | None:
    """The file of a dotted module name inside the package (a package's __init__.py), or None."""
    parts = module.split(".")
    if parts[0] != TOP:
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules a file imports, by dotted name (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_of(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {name for name in found if name.split(".")[0] == TOP}


def closure(roots, stop=()) -> list[pathlib.Path]:
    """Every package file reachable by imports from the root modules (dotted names or package folders),
    not following the modules named in `stop` (nor reaching them)."""
    stopped = {_file_of(name) for name in stop}
    todo = []
    for root in roots:
        folder = PACKAGE.joinpath(*root.split(".")[1:])
        todo += sorted(folder.rglob("*.py")) if folder.is_dir() else [_file_of(root)]
    seen: set[pathlib.Path] = set()
    while todo:
        path = todo.pop()
        if path is None or path in seen or path in stopped or path == PACKAGE / "__init__.py":
            continue
        seen.add(path)
        todo += [_file_of(name) for name in _imports(path)]
    return sorted(seen)


def digest(paths) -> str:
    """sha256 over each file's path inside the package (its name, for a file outside) and its bytes, in sorted
    order (hex, 16 digits): the same sources give the same digest wherever the checkout lies."""
    h = hashlib.sha256()
    for path in sorted(pathlib.Path(p).resolve() for p in paths):
        name = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else path.name
        h.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# What a compiled kernel depends on: every kernel (CUDA-core and tensor-core), the warp primitives, and the
# profile's build of a configuration (its tiles, its compile through the launch path).
KERNEL_ROOTS = ("fa_numba.kernels", "fa_numba.warp", "fa_numba.profile")
# The performance model reads the SASS but never changes it: an edit to it leaves every binary as it was.
MODEL = ("fa_numba.whole_kernel", "fa_numba.cycle_model", "fa_numba.profile_estimate", "fa_numba.machine",
         "fa_numba.decode_estimate")


def kernel_digest() -> str:
    """The digest of every file a kernel build imports (`KERNEL_ROOTS`' closure, the model's modules left out)."""
    return digest(closure(KERNEL_ROOTS, stop=MODEL))
