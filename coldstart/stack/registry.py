"""A real OCI registry (Debian's ``docker-registry``, distribution 2.x) on loopback.

:func:`start_registry` runs one in a directory (``storage/``, ``config.yml``, ``registry.log``);
with ``htpasswd`` it demands Basic auth, with ``tls`` it serves HTTPS only.
:func:`start_auth_registry` and :func:`start_tls_registry` make the password file or the test CA
and certificate themselves; :func:`write_htpasswd` (re)writes a password file (bcrypt), which a
running registry re-reads on its next request. :class:`AccessLog` reads what the registry
served (its access log has one line per request with the bytes sent): the benchmarks and pull
tests count registry bytes with it. :func:`push_layer` pushes a one-layer image for a
lazy-mount run, :func:`push_layout` an OCI layout's image.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import FailedPrecondition
from coldstart.format.writer import LayerResult
from coldstart.lazyfs.spec import LayerSpec
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import OCI_CONFIG, Descriptor, build_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.procs import daemon, free_port, tcp_open

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


@dataclass(frozen=True)
class Registry:
    host: str          # "127.0.0.1:PORT", usable in image references
    root: Path         # storage directory
    access_log: Path   # the daemon's log (one line per request)

    @property
    def url(self) -> str:
        return f"http://{self.host}"


@dataclass(frozen=True)
class AuthRegistry(Registry):
    """A registry that demands HTTP Basic auth (htpasswd) for every request."""

    username: str = "coldstart"
    password: str = "s3cret-pw"


@dataclass(frozen=True)
class TLSRegistry(Registry):
    """A registry serving HTTPS with a certificate signed by its own CA (``ca``: the PEM file
    a client must trust)."""

    ca: Path = Path()

    @property
    def url(self) -> str:
        return f"https://{self.host}"


def registry_config(root: Path, port: int, *, htpasswd: Path | None = None,
                    tls: tuple[Path, Path] | None = None, log_level: str = "info",
                    access_log: bool = True) -> str:
    """docker-registry's YAML config: filesystem storage in ``root``, deletes enabled."""
    auth = ""
    if htpasswd is not None:
        auth = f"auth:\n  htpasswd:\n    realm: coldstart-test\n    path: {htpasswd}\n"
    return (
        "version: 0.1\n"
        f"log:\n  level: {log_level}\n  accesslog:\n"
        f"    disabled: {'false' if access_log else 'true'}\n"
        "storage:\n"
        f"  filesystem:\n    rootdirectory: {root}\n"
        "  delete:\n    enabled: true\n"
        f"{auth}"
        "http:\n"
        f"  addr: 127.0.0.1:{port}\n"
        + (f"  tls:\n    certificate: {tls[0]}\n    key: {tls[1]}\n" if tls else "")
    )


@contextlib.contextmanager
def start_registry(tmp: Path, *, htpasswd: Path | None = None,
                   tls: tuple[Path, Path] | None = None, log_level: str = "info",
                   access_log: bool = True) -> Iterator[Registry]:
    """Run docker-registry in ``tmp`` until the block ends.

    Example::

        with start_registry(tmp / "registry") as reg:
            RegistryClient(insecure_hosts=[reg.host]).push_blob(...)
    """
    if not Path(REGISTRY_BIN).exists():
        raise FailedPrecondition(
            "docker-registry is not installed (apt-get install docker-registry)")
    port = free_port()
    root = tmp / "storage"
    root.mkdir(parents=True, exist_ok=True)
    config = tmp / "config.yml"
    config.write_text(registry_config(root, port, htpasswd=htpasswd, tls=tls,
                                      log_level=log_level, access_log=access_log))
    log = tmp / "registry.log"
    with daemon([REGISTRY_BIN, "serve", str(config)], log=log, ready=tcp_open(port),
                what="docker-registry"):
        yield Registry(host=f"127.0.0.1:{port}", root=root, access_log=log)


def bcrypt_htpasswd_line(username: str, password: str) -> str:
    """One htpasswd line, bcrypt (docker-registry 2.8 accepts no other hash) at the cheapest
    cost (4): the registry checks the password on every request."""
    try:
        import bcrypt
    except ImportError as exc:
        raise FailedPrecondition("the bcrypt package is needed for htpasswd files "
                                 "(pip install 'coldstart[test]')") from exc
    if ":" in username or "\n" in username + password:
        raise FailedPrecondition(f"htpasswd: bad username {username!r}")
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return f"{username}:{hashed}\n"


def write_htpasswd(path: Path, users: Mapping[str, str]) -> Path:
    """Write (replace atomically) an htpasswd file for ``{username: password}``.

    A running docker-registry (2.8.2) notices the change by itself: it checks the file's
    modification time on each request and re-reads it, so a password change needs no restart
    (measured: the new password works, the old one gets 401, on the very next request).

    Example::

        write_htpasswd(tmp / "htpasswd", {"alice": "pw1"})
        with start_registry(tmp, htpasswd=tmp / "htpasswd") as reg: ...
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(bcrypt_htpasswd_line(u, p) for u, p in users.items()))
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def start_auth_registry(tmp: Path, username: str = "coldstart",
                        password: str = "s3cret-pw") -> Iterator[AuthRegistry]:
    """A registry with Basic auth for ``username`` / ``password``."""
    tmp.mkdir(parents=True, exist_ok=True)
    htpasswd = write_htpasswd(tmp / "htpasswd", {username: password})
    with start_registry(tmp, htpasswd=htpasswd) as reg:
        yield AuthRegistry(host=reg.host, root=reg.root, access_log=reg.access_log,
                           username=username, password=password)


def make_ca_and_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a certificate for 127.0.0.1 it signed: ``(ca, cert, key)`` PEMs."""
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "server.key",
                                                     "server.csr", "server.pem"))
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "2", "-subj", "/CN=coldstart test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return ca, cert, key


@contextlib.contextmanager
def start_tls_registry(tmp: Path) -> Iterator[TLSRegistry]:
    """A registry on HTTPS only, with its own CA (``.ca``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ca, cert, key = make_ca_and_cert(tmp)
    with start_registry(tmp, tls=(cert, key)) as reg:
        yield TLSRegistry(host=reg.host, root=reg.root, access_log=reg.access_log, ca=ca)


# -- what the registry served ------------------------------------------------------------------

_ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[\d.]+" (\d{3}) (\d+|-)')


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    status: int
    bytes: int


class AccessLog:
    """Requests a registry logged after the moment this object was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = path.stat().st_size

    def requests(self) -> list[Served]:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            text = f.read().decode(errors="replace")
        out = []
        for m in _ACCESS_RE.finditer(text):
            out.append(Served(m.group(1), m.group(2), int(m.group(3)),
                              0 if m.group(4) == "-" else int(m.group(4))))
        return out

    def blob_requests(self, digest: str) -> list[Served]:
        return [r for r in self.requests() if r.method == "GET"
                and r.path.endswith(f"/blobs/{digest}")]

    def blob_bytes(self, digest: str) -> int:
        return sum(r.bytes for r in self.blob_requests(digest))


def push_layer(host: str, repo: str, blob: bytes | Path, result: LayerResult, *,
               with_annotations: bool = True, pull_host: str | None = None) -> LayerSpec:
    """Push ``blob`` (a converted layer) and a manifest naming it as ``host/repo:v1``; return
    the spec a FUSE server mounts it from (annotations optional: the server then finds them
    in the manifest; ``pull_host``: the host the spec names, e.g. a proxy in front). A big
    blob is best given as its file's ``Path`` (streamed)."""
    ref = Reference.parse(f"{host}/{repo}:v1")
    with RegistryClient(insecure_hosts=[host]) as client:
        client.push_blob(ref, blob, result.digest)
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "rootfs": {"type": "layers", "diff_ids": [result.diff_id]}}).encode()
        cdigest = client.push_blob(ref, config)
        manifest = build_manifest(
            Descriptor(media_type=OCI_CONFIG, digest=cdigest, size=len(config)),
            [Descriptor(media_type=result.media_type, digest=result.digest, size=result.size,
                        annotations=dict(result.annotations))])
        mdigest = client.push_manifest(ref, manifest.to_bytes(), manifest.media_type)
    return LayerSpec(reference=f"{pull_host or host}/{repo}:v1", digest=result.digest,
                     size=result.size, media_type=result.media_type, manifest_digest=mdigest,
                     annotations=dict(result.annotations) if with_annotations else {})


def push_layout(layout_dir: Path, tag: str, dst: str, client: RegistryClient, *,
                storage: Path | None = None) -> None:
    """Copy an OCI layout's image (tag ``tag``) unchanged into the registry as ``dst`` (blobs
    it has are skipped), as ``docker push`` would.

    ``storage``: the registry's own storage directory (ours, on this machine): each blob is
    hard-linked into it instead of uploaded, so a multi-GB image is not stored twice."""
    layout = OciLayout(layout_dir)
    ref = Reference.parse(dst)
    mdesc = layout.resolve(tag)
    body = layout.read_blob(mdesc.digest)
    manifest = json.loads(body)
    for d in [manifest["config"], *manifest["layers"]]:
        if storage is not None:
            _link_blob(storage, ref.repository, layout.blob_path(d["digest"]), d["digest"])
        client.push_blob(ref, layout.blob_path(d["digest"]), d["digest"])
    client.push_manifest(ref, body, mdesc.media_type)


def _link_blob(storage: Path, repository: str, src: Path, digest: str) -> None:
    """Place ``src`` in distribution's filesystem storage (``blobs/sha256/ab/abcd…/data`` and
    the repository's ``_layers`` link) by hard link; a failure leaves the upload to do it."""
    algo, _, hexd = digest.partition(":")
    v2 = storage / "docker" / "registry" / "v2"
    data = v2 / "blobs" / algo / hexd[:2] / hexd / "data"
    link = v2 / "repositories" / repository / "_layers" / algo / hexd / "link"
    try:
        if not data.exists():
            data.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, data)
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.write_text(digest)
    except OSError:
        return
