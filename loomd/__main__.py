"""`python -m loomd [serve]` runs the daemon in the foreground."""

import sys

from .daemon import main

sys.exit(main())
