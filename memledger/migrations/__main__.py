"""`python -m memledger.migrations revision "what changed" --db URL`: a new revision file."""

from memledger.migrations import main

raise SystemExit(main())
