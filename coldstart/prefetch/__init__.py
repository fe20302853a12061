"""Start-up profiles: what a container reads as it starts, recorded in the FUSE layer
(:mod:`coldstart.prefetch.recorder`), kept as JSON and applied to an image
(:mod:`coldstart.prefetch.profile`) so a node fetches that first, in bulk."""
