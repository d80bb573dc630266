"""Entry point of `python -m localhub`."""

from .cli import main

raise SystemExit(main())
