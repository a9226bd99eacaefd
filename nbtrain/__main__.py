"""``python -m nbtrain``: the ``nbtrain`` command."""

from nbtrain.cli import main

raise SystemExit(main())
