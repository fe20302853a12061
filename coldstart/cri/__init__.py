"""The kubelet (CRI) path: an image-service proxy in front of containerd that hands the
registry credentials kubelet sends with ``PullImage`` to the FUSE server (through
:class:`coldstart.oci.keychain.Keychain`), and a small CRI client.

>>> from coldstart.cri import CriProxy                               # doctest: +SKIP
>>> with CriProxy("/run/coldstart/cri.sock", "/run/containerd/containerd.sock",
...               Keychain(Path("/var/lib/coldstart/cri-credentials"))):
...     ...                                                           # doctest: +SKIP
"""

from coldstart.cri.client import ImageServiceClient, RuntimeServiceClient
from coldstart.cri.proxy import CriProxy, credentials_from_auth

__all__ = ["CriProxy", "ImageServiceClient", "RuntimeServiceClient", "credentials_from_auth"]
