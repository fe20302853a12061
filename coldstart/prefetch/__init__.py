"""coldstart.prefetch."""
