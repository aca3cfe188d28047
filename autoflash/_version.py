"""The package version (one place: the fingerprint and the package both read it)."""

__version__ = "0.1.0"
