"""`python -m jdeep.cli`: the `jdeep` command line."""

import sys

from . import main

sys.exit(main())
