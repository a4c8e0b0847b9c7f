"""`python -m lily ...` runs the `lily` command line."""
import sys

from .cli import main

sys.exit(main())
