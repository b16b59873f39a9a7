"""`python -m loomd [serve]` runs the daemon in the foreground."""

import sys

from loomd.daemon import main

sys.exit(main())
