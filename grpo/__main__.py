"""``python -m grpo``: the ``grpo`` command without the console script."""

import sys

from grpo.cli import main

sys.exit(main())
