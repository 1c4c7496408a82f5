"""``python -m benchmarks``: the attention benchmark (:mod:`benchmarks.run`)."""

import sys

from .run import main

sys.exit(main())
