"""The installed package is the one that imports, wherever the user stands (issue 20, item 13).

`python -m fa_numba` puts the working directory first on sys.path. Standing in the folder that holds a
clone named `fa_numba`, that clone (a folder without __init__.py at its top) is a namespace-package
candidate. A regular package found anywhere on sys.path wins over it, so the editable install puts the
project root on sys.path with a static .pth (setup.cfg's `package_dir = =.`), not through setuptools'
import-hook finder, which Python asks only after the path search has settled on the namespace package.
"""

import pathlib
import subprocess
import sys

import fa_numba

ROOT = pathlib.Path(fa_numba.__file__).resolve().parent


def test_a_folder_named_fa_numba_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    (tmp_path / "fa_numba" / "docs").mkdir(parents=True)  # what a clone looks like from its parent folder
    found = subprocess.run([sys.executable, "-c", "import fa_numba; print(fa_numba.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert pathlib.Path(found.stdout.strip()).resolve() == ROOT / "__init__.py", found.stdout
