"""The global loads of v2's tile loop and of bwd-kv's visit loop, read from their sm_90a SASS (run by
test_profile.py's tile-load tests).

Run as a script in a process with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); prints one JSON object: for
the shipped v2 at d = 64, float32, non-causal, compiled for C-contiguous q, k, v ("contiguous") and for strided
views ("strided"), the tile loop's own global loads: how many, how many generic (LD, not LDG), and the
distinct address registers they use; with the argument "backward", the same for bwd-kv at d = 64 (its visit
loop: the loop that issues the atomic adds into dQ), and those adds (REDG) with their address registers.
"""

import json
import os
import re
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from fa_numba import profile, sass  # noqa: E402


def _bases(instructions) -> list:
    return sorted({re.search(r"\[(R\d+)\.64", i.operands).group(1) for i in instructions})


def tile_loads(strided: bool) -> dict:
    cfg = next(profile.configurations(orders=["v2"], head_dims=(64,), dtypes=("float32",), causals=(False,)))
    prof = profile.profile_configuration(dict(cfg, strided=True) if strided else cfg)
    tree = sass.loop_tree(prof.sass)
    tile = max(tree, key=lambda loop: loop.end - loop.start)  # the tile loop holds every other loop
    loads = [i for i in tile.own if i.opcode.split(".")[0] in ("LDG", "LD")]
    return {"loads": len(loads), "generic": sum(i.opcode.split(".")[0] == "LD" for i in loads),
            "bases": _bases(loads)}


def backward_loads() -> dict:
    cfg = next(profile.configurations(orders=["bwd-kv"], head_dims=(64,), dtypes=("float32",), causals=(False,)))
    tree = sass.loop_tree(profile.profile_configuration(cfg).sass)
    (visit,) = [loop for loop in tree if any(i.opcode.startswith("RED") for i in loop.own)]
    loads = [i for i in visit.own if i.opcode.split(".")[0] in ("LDG", "LD")]
    adds = [i for i in visit.own if i.opcode.startswith("RED")]
    return {"loads": len(loads), "generic": sum(i.opcode.split(".")[0] == "LD" for i in loads),
            "bases": _bases(loads), "adds": len(adds), "add_bases": _bases(adds),
            "nested_loads": sum(1 for loop in tree if loop.parent is not None and tree[loop.parent] is visit
                                for i in loop.own if i.opcode.split(".")[0] in ("LDG", "LD"))}


def main() -> int:
    if sys.argv[1:] == ["backward"]:
        json.dump(backward_loads(), sys.stdout)
    else:
        json.dump({"contiguous": tile_loads(False), "strided": tile_loads(True)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
