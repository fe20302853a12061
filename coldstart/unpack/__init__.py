"""coldstart.unpack: layers pulled in full, fast: parallel range requests, parallel
decompression, and containerd's applier semantics (:mod:`coldstart.unpack.applier`,
:mod:`coldstart.unpack.fullpull`)."""
