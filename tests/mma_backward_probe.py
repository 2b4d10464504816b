"""Compile the tensor-core backward's shipped tiles for sm_90a through the launch path and print, as JSON,
what test_mma_backward's SASS test checks: resources, and the HMMA in the smallest loop that holds the
visit's (kv) or key tile's (dq) products. Run with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); no GPU needed.
"""

import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from fa_numba import profile, sass  # noqa: E402  (first: fa_numba chooses the backend before numba.cuda)
from fa_numba.kernels.mma import backward as mb  # noqa: E402


def _count(instructions, prefix):
    return sum(1 for i in instructions if i.opcode.split(".")[0] == prefix)


def main() -> int:
    found = []
    for role in mb.ROLES:
        for d in (64, 128):
            warps, block_q, block_k = mb.default_tiles(role, d)
            config = mb.MmaBackwardConfig(role, "float16", warps, block_q, block_k, d, True, False, True).check()
            kernel = mb.MmaBackwardKernel(config)
            p = profile.profile_kernel(kernel.source, kernel.argtypes(), 32 * warps,
                                       name=f"bwd-{role}-mma d={d}")
            instructions, _, _ = sass.parse_sass(p.sass)
            # the loop holding the visit's products: the one with the most HMMA (kv's dQ loop holds a few)
            loops = [n for n in sass.loop_tree(p.sass) if _count(n.instructions, "HMMA")]
            loop = max(loops, key=lambda n: (_count(n.instructions, "HMMA"), -len(n.instructions)))
            found.append({"role": role, "d": d, "warps": warps, "block_q": block_q, "block_k": block_k,
                          "registers": p.registers, "spill_stores": p.spill_stores, "spill_loads": p.spill_loads,
                          "smem": p.smem, "local": _count(instructions, "LDL") + _count(instructions, "STL"),
                          "hmma": _count(instructions, "HMMA"), "loop_hmma": _count(loop.instructions, "HMMA"),
                          "loop_issued": loop.issued})
    json.dump(found, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
