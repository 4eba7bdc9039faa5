"""`python -m hf_unlearn` is the same as the `hf-unlearn` console script."""

import sys

from .cli import main

sys.exit(main())
