"""The project's exception types. Each names what went wrong and what would be valid."""


class EagleJaxError(Exception):
    """Base class for every error eagle-jax raises on purpose."""


class ConfigError(EagleJaxError, ValueError):
    """An invalid configuration field (names the field, the value and what is valid)."""


class CheckpointError(EagleJaxError):
    """A checkpoint that cannot be read: missing file or tensor, wrong shape, bad format."""


class InputError(EagleJaxError, ValueError):
    """Bad user input: a prompt too long, invalid sampling values, an unreadable prompt file."""
