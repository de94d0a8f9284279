"""``python -m rayline.cli``: the ``rayline`` command, from a checkout without the console script."""

from rayline.cli.main import main

main()
