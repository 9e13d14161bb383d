import sys

from mxmoe.cli import main

sys.exit(main())
