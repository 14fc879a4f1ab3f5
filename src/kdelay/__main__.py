"""``python -m kdelay`` runs the command line."""

from kdelay.cli import main

main()
