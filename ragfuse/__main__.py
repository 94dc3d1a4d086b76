"""``python -m ragfuse``: the ``ragfuse`` command line."""

from ragfuse.cli import main

raise SystemExit(main())
