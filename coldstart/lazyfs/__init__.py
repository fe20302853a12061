"""The FUSE side of lazy pulling: the process that serves lazily mounted layers.

Its modules: ``spec`` (the layer spec, the contract with the gRPC snapshotter), ``client`` (the
control-socket client the snapshotter uses), ``server`` (the FUSE server process), ``fusefs``
(the file system), ``reader`` and ``fetcher`` (the data path), ``mountstate`` and ``mountsys``
(persisted mounts, mount syscalls), ``metrics``. Nothing is imported here: the snapshotter imports
``spec`` and ``client`` without pulling in pyfuse3 or trio.
"""
