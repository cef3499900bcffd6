import sys

from dtorch.cli import main

sys.exit(main())
