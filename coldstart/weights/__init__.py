"""coldstart.weights."""
