import sys

from cde.cli import main

sys.exit(main())
