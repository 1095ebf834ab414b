"""`python -m batchgen.client` runs the `batchgen` command."""

import sys

from batchgen.client.cli import main

sys.exit(main())
