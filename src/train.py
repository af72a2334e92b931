"""`python -m train +experiment=<name>`: thin shim over :func:`pardec.train.main`."""

from pardec.train import main

if __name__ == "__main__":
    main()
