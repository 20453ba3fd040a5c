"""``python -m kvcore`` runs the ``kvcore`` command."""

from kvcore.cli import main

raise SystemExit(main())
