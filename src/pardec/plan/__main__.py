"""``python -m pardec.plan``: see :mod:`pardec.plan`."""

from pardec.plan.cli import main

if __name__ == "__main__":
    main()
