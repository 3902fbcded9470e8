"""Errors a person can act on.

Every failure caused by the user's input (a config value, a file, a flag) is a
`ShipyardError`. The CLI prints its message as one line and exits with its
`exit_code`; tracebacks are shown only with `--debug`.
"""


class ShipyardError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""

    exit_code = 1


class ConfigError(ShipyardError):
    """A config file, preset, override or CLI flag is wrong."""

    exit_code = 2


class DataError(ShipyardError):
    """An input data file is missing, malformed or inconsistent with the config."""

    exit_code = 3


class RunDirError(ShipyardError):
    """The run directory cannot be used (exists already, not writable, ...)."""

    exit_code = 4


class TrainingDiverged(ShipyardError):
    """Training produced too many consecutive non-finite steps."""

    exit_code = 5
