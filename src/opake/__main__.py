import sys

from opake.cli import main

sys.exit(main())
