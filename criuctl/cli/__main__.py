"""`python -m criuctl.cli`: the same entry point as the `criuctl` command."""

import sys

from criuctl.cli.main import main

sys.exit(main())
