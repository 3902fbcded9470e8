"""`python -m shipyard.cli ...` is the `shipyard` command."""

from shipyard.cli.main import entry

entry()
