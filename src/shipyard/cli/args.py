"""What every command group shares: a parser whose bad flag is one line and exit 2."""

from __future__ import annotations

import argparse

from shipyard.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr with exit code 2, like every other input error."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see `{self.prog} --help`)")
