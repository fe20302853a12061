"""coldstart.snapshotter."""
