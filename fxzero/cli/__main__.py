"""`python -m fxzero.cli ...`: the `fxzero` command, for environments without the script on PATH."""

from fxzero.cli import main

main()
