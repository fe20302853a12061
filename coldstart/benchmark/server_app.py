#!/usr/bin/env python3
"""The model server of the ``server`` and ``cuda-like`` bench images (``/app/server.py``).

Runs under the image's python3 with the standard library, torch and safetensors only (it uses
:mod:`coldstart.weights` instead when that is importable). In order, each phase announced by
sd_notify (``STATUS=<phase>`` and ``X_PHASE=<phase>`` on ``$NOTIFY_SOCKET``, when set) and on
stdout (``coldstart-phase <phase>``, so a log-line ready condition works too):

1. ``importing``: import torch, then the modules ``--imports`` lists (one per line);
2. ``libraries``: with ``--touch-libs DIR``, map each shared library there and read a scattered
   few per cent of its pages, as the dynamic loader and CUDA's kernel loading do;
3. ``loading``: read every tensor of the safetensors checkpoint ``--model`` (a file, a
   ``model.safetensors.index.json``, or a directory holding either), ``X_PROGRESS=<0..1>``;
4. ``inference``: one matrix product with the first 2-D weight;
5. ``ready``: listen on ``$HOST:$PORT`` (127.0.0.1:8000), then ``READY=1``. ``GET /infer`` runs
   the product again and answers a small JSON result; ``GET /healthz`` answers ``ok``.

Restored from a snapshot (``coldstart-runc``), the after-restore hook (:func:`on_restore`)
answers one inference and says ``READY=1`` again: a restored server is ready when it answers.

    NOTIFY_SOCKET=/tmp/n.sock PORT=8001 MODEL_PATH=/tmp/model python3 server.py

Environment defaults: ``MODEL_PATH`` (/model), ``PORT``, ``HOST``; ``SERVER_EXIT_WHEN_READY=1``
(or ``--exit-when-ready``) exits 0 instead of serving; ``SERVER_LOADER`` (``auto``,
``coldstart``, ``safetensors``) picks the weight loader. SIGTERM stops it (exit 0).
"""

from __future__ import annotations

import argparse
import http.server
import importlib
import importlib.util
import json
import mmap
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

PAGE = 4096


def notify(*assignments: str) -> None:
    """Send one sd_notify datagram to ``$NOTIFY_SOCKET`` (nothing when unset or unreachable)."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1.0)
            sock.sendto("\n".join(assignments).encode(), address)
    except OSError as exc:
        print(f"server: cannot notify {path}: {exc}", file=sys.stderr, flush=True)


def phase(name: str, *extra: str) -> None:
    print(f"coldstart-phase {name}", flush=True)
    notify(f"STATUS={name}", f"X_PHASE={name}", *extra)


class Progress:
    """``X_PROGRESS`` datagrams, at most one per 1% or 0.2 s."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self._sent, self._at = max(total, 1), 0, -1.0, 0.0

    def add(self, n: int) -> None:
        self.done += n
        frac = min(1.0, self.done / self.total)
        now = time.monotonic()
        if frac >= 1.0 or frac - self._sent >= 0.01 or now - self._at >= 0.2:
            self._sent, self._at = frac, now
            notify("STATUS=loading", "X_PHASE=loading", f"X_PROGRESS={frac:.4f}")


def import_modules(list_file: Path | None) -> tuple[Any, int]:
    import torch

    count = 0
    if list_file is not None:
        for line in list_file.read_text().splitlines():
            name = line.strip()
            if name and not name.startswith("#"):
                importlib.import_module(name)
                count += 1
    return torch, count


def touch_libraries(directory: Path, fraction: float) -> int:
    """Read the first MiB of each library and ``fraction`` of it in runs at random offsets
    (seeded by its name: the same pages every start). Returns the bytes touched."""
    touched = 0
    for path in sorted(directory.iterdir()):
        if path.is_symlink() or not path.is_file() or ".so" not in path.name:
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        rng = random.Random(f"{path.name}:{size}")
        runs = [(0, min(size, 1 << 20))]
        want = int(size * fraction)
        while want > 0:
            length = min(rng.randint(16 * PAGE, 256 * PAGE), want)
            runs.append((rng.randrange(0, max(1, size - length)) // PAGE * PAGE, length))
            want -= length
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for start, length in sorted(runs):
                end = min(size, start + length)
                m[start:end:PAGE]       # one byte per page faults every page in
                touched += end - start
    return touched


def checkpoint_files(model: Path) -> list[Path]:
    """The safetensors files of ``model`` (a file, an index, or a directory of either)."""
    if model.is_dir():
        index = model / "model.safetensors.index.json"
        if index.is_file():
            model = index
        else:
            files = sorted(model.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors file in {model}")
            return files
    if model.name.endswith(".index.json"):
        weight_map = json.loads(model.read_text())["weight_map"]
        return [model.parent / name for name in sorted(set(weight_map.values()))]
    return [model]


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for k, v in header.items() if k != "__metadata__")


def load_weights(files: list[Path]) -> tuple[dict[str, Any], bool]:
    """Every tensor of ``files`` on the CPU, with ``X_PROGRESS`` as the bytes arrive; and
    whether they are views of the files' memory maps (``coldstart.weights``' mmap path)
    rather than copies."""
    progress = Progress(sum(_header_bytes(f) for f in files))
    tensors: dict[str, Any] = {}
    loader = os.environ.get("SERVER_LOADER", "auto")   # auto, coldstart or safetensors
    has_coldstart = importlib.util.find_spec("coldstart") is not None \
        and importlib.util.find_spec("coldstart.weights") is not None
    if loader == "coldstart" or (loader == "auto" and has_coldstart):
        from coldstart.weights import LoadStats, iter_load

        mapped = True
        for f in files:
            stats = LoadStats()
            for name, t in iter_load(f, "cpu", progress=progress.add, stats=stats):
                tensors[name] = t
            print(f"server: {f.name}: {stats.path}", flush=True)
            # a node's socket named (a bench mode measuring the fast path): a fallback to the
            # mount is a failure here, not a slower run of the same name
            if os.environ.get("COLDSTART_FILES_SOCKET") and "files socket" not in stats.path:
                raise RuntimeError(f"{f} was not read through the files socket "
                                   f"({stats.path}): see the log above")
            mapped = mapped and "mmap" in stats.path
        return tensors, mapped
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():    # noqa: SIM118 (safe_open has no __iter__)
                t = st.get_tensor(name).clone()   # safetensors maps the file: read it all
                tensors[name] = t
                progress.add(t.numel() * t.element_size())
    return tensors, False


#: madvise(2) advice: fault a range in, as reads would (Linux 5.14+)
MADV_POPULATE_READ = 22


def populate(tensors: dict[str, Any], workers: int = 8) -> int:
    """Fault every page of ``tensors`` (views of file maps) in, ``workers`` ranges at once,
    as ``coldstart.weights`` did when it loaded them: a process restored from a snapshot has
    its file maps back but none of their pages. The bytes populated."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    spans: list[tuple[int, int]] = []
    for t in sorted(tensors.values(), key=lambda t: t.data_ptr()):
        start = t.data_ptr() // PAGE * PAGE
        end = t.data_ptr() + t.numel() * t.element_size()
        if spans and start <= spans[-1][1] and end - spans[-1][0] <= 64 << 20:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))

    def one(span: tuple[int, int]) -> int:
        if libc.madvise(span[0], span[1] - span[0], MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
        return span[1] - span[0]

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(one, spans))


def first_matrix(tensors: dict[str, Any]) -> tuple[str, Any]:
    for name in sorted(tensors):
        if tensors[name].dim() == 2:
            return name, tensors[name]
    raise ValueError("the checkpoint has no 2-D tensor")


class Model:
    def __init__(self, torch: Any, tensors: dict[str, Any]) -> None:
        self.torch = torch
        self.tensors = tensors
        self.name, self.weight = first_matrix(tensors)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(1, self.weight.shape[1], generator=gen).to(self.weight.dtype)
        self.lock = threading.Lock()

    def infer(self) -> dict[str, Any]:
        with self.lock, self.torch.no_grad():
            t0 = time.monotonic()
            y = self.x @ self.weight.t()
            ms = (time.monotonic() - t0) * 1000
        return {"ok": True, "weight": self.name, "shape": list(y.shape),
                "sum": round(float(y.float().sum()), 4), "argmax": int(y.argmax()),
                "ms": round(ms, 2), "tensors": len(self.tensors)}


def make_handler(model: Model) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] == "/infer":
                self._send(200, json.dumps(model.infer()).encode() + b"\n", "application/json")
            elif self.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


#: the after-restore signal of coldstart-runc's default config (``snapshot.signal``)
RESTORE_SIGNAL = "SIGRTMIN+6"


def on_restore(fn: Any) -> None:
    """Call ``fn()`` after each restore of this process from a snapshot: through
    ``coldstart.snapshot.after_restore`` when the image carries coldstart, else by handling
    the same signal here."""
    try:
        from coldstart.snapshot import after_restore
    except ImportError:
        signal.signal(signal.SIGRTMIN + 6, lambda signum, frame: fn())
        return
    after_restore(fn, signal=RESTORE_SIGNAL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="coldstart bench model server")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("MODEL_PATH", "/model")))
    ap.add_argument("--imports", type=Path, default=None,
                    help="file listing modules to import after torch, one a line")
    ap.add_argument("--touch-libs", type=Path, default=None,
                    help="directory of shared libraries to map and partly read")
    ap.add_argument("--touch-fraction", type=float, default=0.03)
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    ap.add_argument("--exit-when-ready", action="store_true",
                    default=os.environ.get("SERVER_EXIT_WHEN_READY") == "1")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        phase("importing")
        torch, imported = import_modules(args.imports)
        print(f"server: imported torch {torch.__version__} and {imported} modules "
              f"({time.monotonic() - t0:.2f} s)", flush=True)
        if args.touch_libs is not None:
            phase("libraries")
            n = touch_libraries(args.touch_libs, args.touch_fraction)
            print(f"server: touched {n / 1e6:.0f} MB of libraries", flush=True)
        phase("loading", "X_PROGRESS=0.0000")
        files = checkpoint_files(args.model)
        t1 = time.monotonic()
        tensors, mapped = load_weights(files)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        secs = time.monotonic() - t1
        print(f"server: loaded {len(tensors)} tensors, {total / 1e9:.2f} GB in {secs:.2f} s "
              f"({total / 1e6 / max(secs, 1e-9):.0f} MB/s)", flush=True)
        phase("inference")
        model = Model(torch, tensors)
        result = model.infer()
        print(f"server: inference {json.dumps(result)}", flush=True)
        server = http.server.ThreadingHTTPServer((args.host, args.port), make_handler(model))
    except Exception as exc:
        print(f"server: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        notify(f"STATUS=failed: {type(exc).__name__}: {exc}"[:2000], "X_PHASE=failed")
        return 1
    print(f"coldstart-phase ready (listening on {args.host}:{server.server_address[1]}, "
          f"{time.monotonic() - t0:.2f} s after start)", flush=True)
    notify("READY=1", "STATUS=ready", "X_PHASE=ready")

    def restored() -> None:     # a restored server is ready once it answers an inference
        if mapped:
            # its weights are in memory again, as after a load, before it says it is ready
            # (they came through the image, not the snapshot)
            t = time.monotonic()
            try:
                n = populate(tensors)
                print(f"server: populated {n / 1e9:.2f} GB of mapped weights in "
                      f"{time.monotonic() - t:.2f} s (restored)", flush=True)
            except OSError as exc:      # the inference faults them in instead
                print(f"server: cannot populate the weights: {exc}", file=sys.stderr,
                      flush=True)
        print(f"server: inference {json.dumps(model.infer())} (restored)", flush=True)
        notify("READY=1", "STATUS=ready", "X_PHASE=ready", "X_RESTORED=1")

    on_restore(restored)
    if args.exit_when_ready:
        server.server_close()
        return 0

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    notify("STOPPING=1", "STATUS=stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
