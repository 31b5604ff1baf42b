import sys

from opweave.cli import main

sys.exit(main())
