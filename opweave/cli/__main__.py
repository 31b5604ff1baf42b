"""`python -m opweave.cli`, as `python -m opweave`."""

import sys

from opweave.cli import main

sys.exit(main())
