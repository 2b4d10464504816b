"""The global loads of v2's tile loop, read from its sm_90a SASS (run by test_profile.py's tile-load test).

Run as a script in a process with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); prints one JSON object: for
the shipped v2 at d = 64, float32, non-causal, compiled for C-contiguous q, k, v ("contiguous") and for strided
views ("strided"), the tile loop's own global loads: how many, how many generic (LD, not LDG), and the
distinct address registers they use.
"""

import json
import os
import re
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from fa_numba import profile, sass  # noqa: E402


def tile_loads(strided: bool) -> dict:
    cfg = next(profile.configurations(orders=["v2"], head_dims=(64,), dtypes=("float32",), causals=(False,)))
    prof = profile.profile_configuration(dict(cfg, strided=True) if strided else cfg)
    tree = sass.loop_tree(prof.sass)
    tile = max(tree, key=lambda loop: loop.end - loop.start)  # the tile loop holds every other loop
    loads = [i for i in tile.own if i.opcode.split(".")[0] in ("LDG", "LD")]
    bases = {re.search(r"\[(R\d+)\.64", i.operands).group(1) for i in loads}
    return {"loads": len(loads), "generic": sum(i.opcode.split(".")[0] == "LD" for i in loads),
            "bases": sorted(bases)}


def main() -> int:
    json.dump({"contiguous": tile_loads(False), "strided": tile_loads(True)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
