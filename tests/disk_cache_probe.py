"""What tests/test_disk_cache.py checks, computed with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0; no GPU is
needed to build a kernel's dispatcher, only to compile it). Prints one JSON object:

- keys: the cache key (`disk_cache.kernel_key`) of each shipped configuration of v2, v2-mma and bwd-kv-mma at
  d = 64;
- mods: the key of v2 with a built-in mod (alibi), or the reason a user's mod makes it uncacheable;
- index: the index keys of one function with and without a register cap (a stub codegen: no GPU here);
- folder: the cache folder of this code.
"""

import json
import sys

import numpy as np

from fa_numba import mods, profile
from fa_numba.kernels import VARIANTS, disk_cache
from fa_numba.kernels.score_mod import KernelMod


def user_bias(score, b, h, i, j):  # a user's score mod, defined outside fa_numba
    return score + 0.5


def user_grad(score, b, h, i, j):
    return 1.0


class StubCodegen:
    def magic_tuple(self):
        return ("runtime 13.0", (9, 0))


def main() -> None:
    configs = [c for c in profile.configurations(orders=["v2", "v2-mma", "bwd-kv-mma"], head_dims=(64,))]
    keys = {json.dumps(c, sort_keys=True): disk_cache.kernel_key(profile._build(c).source) for c in configs}
    v2 = VARIANTS["v2"]
    found = {}
    for name, mod in (("alibi", mods.alibi(np.array([0.5, 0.25]))), ("user", mods.ScoreMod(user_bias, grad=user_grad))):
        source = v2.make(32, 32, 64, False, "none", mod=KernelMod.of(mod)).source
        try:
            found[name] = disk_cache.kernel_key(source)
        except disk_cache.Uncacheable as err:
            found[name] = f"uncacheable: {err}"
    fn = profile._build(configs[0]).source
    cache = disk_cache._cache_class()
    plain = cache(fn, disk_cache.kernel_key(fn), ())
    capped = cache(fn, disk_cache.kernel_key(fn), (("max_registers", "168"),))
    index = [repr(c._index_key(("sig",), StubCodegen())) for c in (plain, capped)]
    json.dump({"keys": keys, "mods": found, "index": index, "folder": str(disk_cache.cache_dir()),
               "path": plain.cache_path}, sys.stdout)


if __name__ == "__main__":
    main()
