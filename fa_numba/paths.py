"""Output paths checked before a long run, so a command never computes for minutes and then fails to write.

Shared by the CLI's compare / sweep (cli.py) and profile (profile.py), which each turn the message into
their parser's usage error.
"""

from __future__ import annotations

import os


def unwritable(path: str, figure: bool = False) -> str | None:
    """Why `path` cannot be written, or None: it must not be a directory, its directory must exist, it must
    open for appending (so an existing file is not truncated; a file the check created is removed again),
    and a figure must be in a format matplotlib saves."""
    if os.path.isdir(path):
        return f"{path} is a directory, expected a file path"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist (for {path})"
    if figure:
        from matplotlib.backend_bases import FigureCanvasBase

        ext = os.path.splitext(path)[1][1:].lower()
        formats = FigureCanvasBase.get_supported_filetypes()
        if ext and ext not in formats:  # no extension: matplotlib saves its default format (PNG)
            return f"matplotlib cannot save format {ext!r} ({path}); it saves {', '.join(sorted(formats))}"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        return f"cannot write {path}: {err.strerror or err}"
    if not existed:
        os.remove(path)
    return None
