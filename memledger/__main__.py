"""`python -m memledger`: the same command line as the `memledger` console script."""

from __future__ import annotations

from memledger.cli import main

# Spawned worker processes import this module as `__mp_main__`: only run when executed.
if __name__ == "__main__":
    raise SystemExit(main())
