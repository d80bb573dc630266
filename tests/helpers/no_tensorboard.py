"""``python no_tensorboard.py SCRIPT ARGS...``: run SCRIPT as where tensorboard is not installed
(any import of it raises ImportError), the rest of the environment unchanged."""

import os
import runpy
import sys

from absent import as_if_absent

as_if_absent("tensorboard")
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` would
runpy.run_path(sys.argv[0], run_name="__main__")
