"""coldstart.probe."""
