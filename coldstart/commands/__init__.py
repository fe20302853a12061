"""coldstart.commands."""
