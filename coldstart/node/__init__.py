"""coldstart.node."""
