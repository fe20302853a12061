"""Who the files socket serves: a mount of the layer's own FUSE connection in the caller's
mount table counts; a path that merely names the node's directories does not."""

from __future__ import annotations

from coldstart.lazyfs.fileshare import shows_layer

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:53 / /var/lib/coldstart/fuse rw,nosuid,nodev shared:20 - fuse.coldstart coldstart rw
41 22 0:53 /sha256-abc-1 /var/lib/coldstart/snapshots/7/fs ro shared:20 - fuse.coldstart x ro
"""


def test_a_mount_of_the_layers_connection_shows_it_whatever_its_path() -> None:
    assert shows_layer(MOUNTINFO, ("0:53", "/sha256-abc-1"))          # its bind, or
    assert shows_layer(MOUNTINFO.splitlines()[1], ("0:53", "/sha256-abc-1"))   # the whole fs
    bind_only = MOUNTINFO.splitlines()[2].replace("/var/lib/coldstart/snapshots/7/fs", "/")
    assert shows_layer(bind_only, ("0:53", "/sha256-abc-1"))          # a container's root
    # another layer's bind on the same connection shows that layer only
    other = MOUNTINFO.splitlines()[2]
    assert not shows_layer(other, ("0:53", "/sha256-def-1"))
    assert not shows_layer(other, ("0:53", "/sha256-abc"))           # a prefix is not it
    assert shows_layer(other.replace("/sha256-abc-1 ", "/sha256-abc-1/models "),
                       ("0:53", "/sha256-abc-1"))                   # a directory in it is


def test_the_node_s_paths_on_another_device_show_nothing() -> None:
    # a container's volume (or its own tmpfs, or an overlay naming those paths) mounted at
    # exactly the node's paths: another device
    forged = """\
22 1 0:90 / / rw - overlay overlay rw,lowerdir=/var/lib/coldstart/snapshots/7/fs
40 22 0:91 / /var/lib/coldstart/fuse rw - tmpfs tmpfs rw
41 22 0:92 /sha256-abc-1 /var/lib/coldstart/snapshots/7/fs rw - tmpfs tmpfs rw
"""
    assert not shows_layer(forged, ("0:53", "/sha256-abc-1"))
    assert not shows_layer("", ("0:53", "/sha256-abc-1"))
