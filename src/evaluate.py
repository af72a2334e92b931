"""`python -m evaluate +method=<name>`: thin shim over :func:`pardec.evaluate.main`."""

from pardec.evaluate import main

if __name__ == "__main__":
    main()
