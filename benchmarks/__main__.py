"""``python -m benchmarks``: the suite, benchmarks/scripts/suite.py."""

from benchmarks.scripts.suite import main

raise SystemExit(main())
