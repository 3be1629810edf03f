"""The package's version, in one place below everything that reports it."""

__version__ = "0.1.0"
