"""``python -m pardec.plan``: see :mod:`pardec.plan`."""

from pardec.plan.cli import main

main()
