"""``python -m pardec.bench <subcommand>``: see :mod:`pardec.bench`."""

import sys

from pardec.bench import COMMANDS, __doc__
from pardec.subcommands import dispatch

if __name__ == "__main__":
    result = dispatch("pardec.bench", __doc__.splitlines()[0], COMMANDS)
    sys.exit(result if isinstance(result, int) else 0)
