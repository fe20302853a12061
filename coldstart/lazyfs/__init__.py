"""The FUSE side of lazy pulling: the process that serves lazily mounted layers.

Its modules: ``spec`` (the layer spec, the contract with the gRPC snapshotter), ``control`` (the
control protocol, both sides: framing, ops, error payloads, dispatch), ``client`` (the
control-socket client the snapshotter uses), ``server`` (the FUSE server process: wiring and
lifecycle), ``layers`` (the layer table: mount/check/unmount, bind mounts, restore), ``resolver``
(layer spec -> verified TOC and layer reader), ``fusefs`` (the file system), ``fusewire`` (the
FUSE kernel protocol on ``/dev/fuse``: mount, request loop, answers), ``reader`` and
``fetcher`` (the data path), ``mountstate`` and ``mountsys`` (persisted mounts, mount syscalls),
``holder`` and ``handover`` (the process that keeps the FUSE connection open, and the takeover
of a dead server's connection), ``reclaim`` (an unmounted layer's cache space), ``memory``
(glibc's heap), ``metrics``, ``fileshare`` and ``filewire`` (the files socket: whole ranges
of lazily mounted files for loaders in containers, and its protocol). Nothing is imported
here: the snapshotter imports ``spec``, ``client`` and ``control`` without pulling in trio.
"""
