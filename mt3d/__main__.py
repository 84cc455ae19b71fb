"""``python -m mt3d`` runs the mt3d command."""

import sys

from .cli import main

sys.exit(main())
