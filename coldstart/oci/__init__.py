"""coldstart.oci."""
