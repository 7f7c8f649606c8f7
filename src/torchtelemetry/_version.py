"""The package version, importable from any layer without importing the top level."""

__version__ = "0.1.0"
