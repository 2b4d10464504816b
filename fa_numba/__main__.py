import sys

from fa_numba.cli import main

sys.exit(main())
