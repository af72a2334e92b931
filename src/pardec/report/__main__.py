"""``python -m pardec.report <subcommand>``: see :mod:`pardec.report`."""

import sys

from pardec.report import COMMANDS, __doc__
from pardec.subcommands import dispatch

if __name__ == "__main__":
    result = dispatch("pardec.report", __doc__.splitlines()[0], COMMANDS)
    sys.exit(result if isinstance(result, int) else 0)
