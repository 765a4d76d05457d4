"""nsp: optimizer state in storage tiers, updated near where it lives."""

__version__ = "0.1.0"
