"""`python -m snowcat.stages RUN_DIR STAGE [--item I]`: run one stage unit (see pipeline.runner)."""

import sys

from snowcat.pipeline.runner import main

sys.exit(main())
