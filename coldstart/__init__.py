"""coldstart: make big GPU containers start fast."""

__version__ = "0.1.0"

