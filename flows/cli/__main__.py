"""``python -m flows.cli``: the ``nvrx-pipeline`` command."""

import sys

from flows.cli import main

sys.exit(main())
