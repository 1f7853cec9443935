import sys

from cde.train.program import main

sys.exit(main())
