"""`python -m clef_worker`: the process the front spawns."""

import sys

from clef_worker.main import main

sys.exit(main())
