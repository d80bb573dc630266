"""``as_if_absent(package)``: in a script the tests run, make any import of ``package`` raise
ImportError, as where it is not installed."""

import sys


def as_if_absent(package: str) -> None:
    # Its submodules go too: a script forked from the zygote inherits them imported, and an
    # import of a submodule found in sys.modules never looks at its package.
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]
    sys.modules[package] = None  # what an import finds: ImportError
