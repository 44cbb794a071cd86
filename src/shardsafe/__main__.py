"""``python -m shardsafe``: the command line (see :mod:`shardsafe.cli`)."""

from .cli import entry_point

entry_point()
