"""Compile the given configurations for sm_90a through the launch path and print their profiles as JSON.

    python tests/profile_configs.py '[{"variant": "v2", "head_dim": 64, ...}, ...]'

Run with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0), two configurations at a time; a line per configuration
goes to stderr as it finishes. The slow tier's live check of the committed SASS table uses it.
"""

import concurrent.futures
import json
import sys
import time

from fa_numba import profile


def main() -> None:
    configs = json.loads(sys.argv[1])
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        futures = [pool.submit(profile.profile_configuration, cfg) for cfg in configs]
        found = []
        for index, (cfg, future) in enumerate(zip(configs, futures), 1):
            found.append(future.result().as_dict())
            print(f"[{index}/{len(configs)}] {cfg['variant']} d={cfg['head_dim']} {cfg['dtype']} "
                  f"causal={cfg['causal']} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
