"""``python -m ddpwire``: the same as the ``ddpwire`` command."""
import sys

from .cli import main

sys.exit(main())
