"""`python -m snowcat.stages RUN_DIR STAGE [--item I]`: run one stage unit (see pipeline.runner)."""

import sys

from snowcat.pipeline.context import catch_notice_early

catch_notice_early()  # before the runner's imports: a scheduler's early notice is kept, not fatal

from snowcat.pipeline.runner import main  # noqa: E402

sys.exit(main())
