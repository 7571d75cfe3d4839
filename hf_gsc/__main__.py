"""``python -m hf_gsc``: the ``hf-gsc`` command."""
import sys

from .cli import main


if __name__ == "__main__":  # importing the module (documentation tools inspect every submodule) runs nothing
    sys.exit(main())
