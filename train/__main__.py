import sys

from ringfeed.train.cli import main

sys.exit(main())
