"""``python -m hf_gsc``: the ``hf-gsc`` command."""
import sys

from .cli import main

sys.exit(main())
