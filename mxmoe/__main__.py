import sys

from mxmoe.cli import main

if __name__ == "__main__":  # importable without running the CLI (multiprocessing's spawn imports __main__)
    sys.exit(main())
