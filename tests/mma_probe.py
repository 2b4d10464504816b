"""Compile the tensor-core kernels' shipped-size configurations for sm_90a through the launch path and print,
as JSON, what test_mma_forward's SASS test checks: resources, and per tile-loop iteration the HMMA, LDSM and
copy instructions. Run with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); no GPU needed.
"""

import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from fa_numba import profile, sass  # noqa: E402  (first: fa_numba chooses the backend before numba.cuda)
from fa_numba.kernels.mma import engine_v1, engine_v2  # noqa: E402
from fa_numba.kernels.mma.engine import MmaConfig  # noqa: E402

CONFIGS = [("v2", "float16", 4, 64, 64), ("v2", "float16", 4, 32, 128), ("v2", "bfloat16", 4, 64, 64),
           ("v1", "float16", 4, 64, 64),
           ("v2", "float16", 4, 16, 192), ("v1", "float16", 4, 16, 192)]  # order, kind, warps, B_c, d (192: MLA's d_qk)
ORDERS = {"v1": (engine_v1.kernel_source, engine_v1.MmaV1Kernel),
          "v2": (engine_v2.kernel_source, engine_v2.MmaV2Kernel)}


def _count(instructions, prefix):
    return sum(1 for i in instructions if i.opcode.split(".")[0] == prefix)


def main() -> int:
    found = []
    for order, kind, warps, block_k, d in CONFIGS:
        for causal in (False, True):
            config = MmaConfig(kind, warps, block_k, d, causal, async_copy=True).check()
            source, kernel = ORDERS[order]
            built = kernel(config, source)  # its argtypes end with the (empty) captured-array tuple
            p = profile.profile_kernel(built.source, built.argtypes(), 32 * warps, name=f"{order}-mma {kind} d={d}")
            instructions, _, _ = sass.parse_sass(p.sass)
            # the tile loop: the smallest holding every HMMA (whole_kernel's rule). Not the smallest holding any:
            # in a causal v2 build the exact path's tile issues K_j+1 after P V and rejoins the body after S, a
            # back edge the loop finder reads as a second loop overlapping the first, holding half the HMMA
            total = _count(instructions, "HMMA")
            tiles = [n for n in sass.loop_tree(p.sass) if _count(n.instructions, "HMMA") == total]
            tile = min(tiles, key=lambda n: len(n.instructions))
            found.append({"order": order, "kind": kind, "warps": warps, "block_k": block_k, "d": d, "causal": causal,
                          "registers": p.registers, "spill_stores": p.spill_stores, "spill_loads": p.spill_loads,
                          "smem": p.smem, "local": _count(instructions, "LDL") + _count(instructions, "STL"),
                          "tile_local": _count(tile.instructions, "LDL") + _count(tile.instructions, "STL"),
                          "tile_issued": tile.issued, "tile_hmma": _count(tile.instructions, "HMMA"),
                          "tile_ldsm": _count(tile.instructions, "LDSM"),
                          "tile_ldgsts": _count(tile.instructions, "LDGSTS"),
                          "tile_ldg": _count(tile.instructions, "LDG")})
    json.dump(found, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
