"""coldstart.benchmark."""
