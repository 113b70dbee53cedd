import sys

from ringfeed.train.cli import main

if __name__ == "__main__":  # (loader workers started by a forkserver import this module again)
    sys.exit(main())
