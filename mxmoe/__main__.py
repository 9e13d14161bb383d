import sys

from mxmoe.cli import main

if __name__ == "__main__":  # not when a spawned process (bench train's rows) imports it
    sys.exit(main())
