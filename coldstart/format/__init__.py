"""coldstart.format."""
