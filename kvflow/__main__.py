"""``python -m kvflow`` runs the ``kvflow`` command."""

from kvflow.cli import app

app()
