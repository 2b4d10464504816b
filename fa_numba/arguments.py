"""Command-line arguments checked before a long run, shared by compare / sweep (cli.py), profile (profile.py)
and the ring demo (distributed.py): positive integers within int32, head dims, and output paths (so a command
never computes for minutes and then fails to write). Each command turns the message into its parser's usage
error.
"""

from __future__ import annotations

import argparse
import os

INT32_MAX = 2**31 - 1  # sizes, tiles and positions are int32 in the kernels (as masks.py bounds its ints)


def positive(text: str) -> int:
    """argparse type: an int in [1, INT32_MAX]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a positive integer <= {INT32_MAX} (the kernels index in int32), "
                                         f"got {value}")
    return value


def head_dim(text: str) -> int:
    """argparse type: a head dim d in [1, MAX_HEAD_DIM], the largest any kernel takes."""
    from fa_numba.kernels.common import MAX_HEAD_DIM

    value = positive(text)
    if value > MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"expected a head dim of at most {MAX_HEAD_DIM} (the kernels' largest), "
                                         f"got {value}")
    return value


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
