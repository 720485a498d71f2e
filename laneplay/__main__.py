import sys

from laneplay.cli import main

sys.exit(main())
