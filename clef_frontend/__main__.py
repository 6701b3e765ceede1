"""`python -m clef_frontend` is the same command as the `clef-serve` console script."""

from clef_frontend.cli import main

raise SystemExit(main())
