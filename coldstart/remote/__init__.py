"""coldstart.remote."""
