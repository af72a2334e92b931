"""``python -m pardec.rehearse``: see :mod:`pardec.rehearse`."""

import sys

from pardec.rehearse.cli import main

if __name__ == "__main__":
    sys.exit(main())
