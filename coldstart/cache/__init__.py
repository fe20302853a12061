"""coldstart.cache."""
