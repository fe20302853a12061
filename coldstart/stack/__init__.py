"""Real daemons on this machine, for tests, ``bench/`` and the demo (later ``coldstart bench
--embedded``).

Every helper here starts a real daemon on loopback (127.0.0.1 or a unix socket) in a temporary
directory it is given, in its own process group, waits until it answers, and stops it by PID
when its ``with`` block ends, even on failure; mounts left under the directory are undone. No
pytest here: ``tests/fixtures/*.py`` wrap these in session fixtures.

- :mod:`.procs`: start/wait/stop a process, free ports, readiness checks.
- :mod:`.mounts`: undo the mounts left below a directory.
- :mod:`.registry`: Debian's ``docker-registry`` (plain, Basic auth, TLS), its access log,
  pushing a one-layer image.
- :mod:`.containerd`: containerd 1.6 with its own root, state and socket.
- :mod:`.snapshotter`: ``coldstart snapshotter`` (which spawns ``coldstart fuse-server``), the
  snapshotter + containerd stack, and a stand-alone ``coldstart fuse-server``.
- :mod:`.redis`: ``redis-server``; :mod:`.s3`: moto's S3 server.

Failures to start are :class:`~coldstart.errors.Unavailable` (the log's tail in the message);
a missing binary is :class:`~coldstart.errors.FailedPrecondition`.
"""
