"""``python -m pardec.rehearse``: see :mod:`pardec.rehearse`."""

import sys

from pardec.rehearse.cli import main

sys.exit(main())
