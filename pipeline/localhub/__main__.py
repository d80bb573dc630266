"""Entry point of `python -m pipeline.localhub`."""

from .cli import main

raise SystemExit(main())
