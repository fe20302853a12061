#!/usr/bin/env python3
"""The app of the ``compile`` bench image (``/app/compile_app.py``): a model compiled at start.

Runs under the image's python3 with the standard library and torch only. It builds a small
transformer (six blocks of LayerNorm, 4-head self-attention over 256 features, LayerNorm and a
256-1024-256 GELU MLP; a 256-to-16 linear head; ``torch.manual_seed(0)``) and runs it once on a
seeded ``(2, 32, 256)`` input, compiled: the first call of a compiled model is what a warm-up
cache (Inductor's, issue 51) saves. In order, each phase announced by sd_notify
(``STATUS=<phase>`` and ``X_PHASE=<phase>`` on ``$NOTIFY_SOCKET``, when set) and on stdout
(``coldstart-phase <phase>``):

1. ``importing``: import torch;
2. ``building``: the model and the input;
3. ``warm-up``: compile and make the first call;
4. ``ready``: one JSON line on stdout, ``{"result": <sum of the output, 6 decimals>,
   "compile_s": <seconds of compilation and first call>, "mode": <mode>}``, then ``READY=1``.

It then stays up until SIGTERM or SIGINT (exit 0); ``COMPILE_EXIT_WHEN_READY=1`` exits 0 at once.
Restored from a snapshot (``coldstart-runc``), the process is told so by the after-restore
hook (:func:`on_restore`): it calls the compiled model once more, prints the same JSON line
with ``"restored": true`` and says ``READY=1`` again, which is when a restored start is ready.

``COMPILE_MODE`` picks the compilation:

* ``jit`` (default): ``torch.compile(model)`` (Inductor; its caches go to
  ``$TORCHINDUCTOR_CACHE_DIR``);
* ``aoti``: AOTInductor: the package ``$TORCHINDUCTOR_CACHE_DIR/coldstart-aoti/model.pt2`` is
  loaded when there; else (or when it does not load: a warning on stderr) the model is exported,
  compiled and packaged there (a temporary name, then renamed), and loaded;
* ``eager``: no compilation (the tests' mode).

``$TORCHINDUCTOR_CACHE_DIR`` defaults to ``<tmp>/coldstart-inductor``; the app creates it.

    NOTIFY_SOCKET=/tmp/n.sock COMPILE_MODE=aoti python3 compile_app.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

MODES = ("jit", "aoti", "eager")
AOTI_PACKAGE = os.path.join("coldstart-aoti", "model.pt2")   # under $TORCHINDUCTOR_CACHE_DIR
DIM, HEADS, BLOCKS, OUT = 256, 4, 6, 16
INPUT_SHAPE = (2, 32, DIM)


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
        print(f"compile_app: cannot notify {path}: {exc}", file=sys.stderr, flush=True)


def phase(name: str, *extra: str) -> None:
    print(f"coldstart-phase {name}", flush=True)
    notify(f"STATUS={name}", f"X_PHASE={name}", *extra)


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


def build_model() -> tuple[Any, Any]:
    """The model (eval mode, seeded) and its input (from a seeded generator)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(DIM)
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
            self.ln2 = nn.LayerNorm(DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

        def forward(self, x: Any) -> Any:
            y = self.ln1(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
            self.head = nn.Linear(DIM, OUT)

        def forward(self, x: Any) -> Any:
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(*INPUT_SHAPE, generator=torch.Generator().manual_seed(1))
    return model, x


def aoti_runner(torch: Any, model: Any, x: Any, package: str) -> Any:
    """The AOTInductor-compiled model: ``package`` loaded when it loads, else made there."""
    import torch._inductor

    if os.path.exists(package):
        try:
            runner = torch._inductor.aoti_load_package(package)
            print(f"compile_app: loaded the AOTInductor package {package}", flush=True)
            return runner
        except Exception as exc:    # corrupt, or made by another torch or for another model
            print(f"compile_app: warning: cannot load {package} "
                  f"({type(exc).__name__}: {exc}); compiling again", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(package), exist_ok=True)
    tmp = f"{package[:-len('.pt2')]}.tmp-{os.getpid()}.pt2"    # the packager wants .pt2
    try:
        exported = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(exported, package_path=tmp)
        os.replace(tmp, package)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"compile_app: compiled the AOTInductor package {package}", flush=True)
    return torch._inductor.aoti_load_package(package)


def main() -> int:
    mode = os.environ.get("COMPILE_MODE", "jit") or "jit"
    if mode not in MODES:
        print(f"compile_app: COMPILE_MODE={mode!r} is none of {', '.join(MODES)}",
              file=sys.stderr, flush=True)
        return 2
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "coldstart-inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache       # before torch reads it
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        phase("importing")
        import torch

        print(f"compile_app: imported torch {torch.__version__} "
              f"({time.monotonic() - t0:.2f} s)", flush=True)
        phase("building")
        model, x = build_model()
        if mode != "eager":
            os.makedirs(cache, exist_ok=True)
        with torch.no_grad():
            phase("warm-up")
            t1 = time.monotonic()
            run: Any
            if mode == "jit":
                run = torch.compile(model)
            elif mode == "aoti":
                run = aoti_runner(torch, model, x, os.path.join(cache, AOTI_PACKAGE))
            else:
                run = model
            y = run(x)
            compile_s = time.monotonic() - t1
    except Exception as exc:
        print(f"compile_app: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        notify(f"STATUS=failed: {type(exc).__name__}: {exc}"[:2000], "X_PHASE=failed")
        return 1
    print(f"coldstart-phase ready ({mode}: first call {compile_s:.2f} s, "
          f"{time.monotonic() - t0:.2f} s after start)", flush=True)
    print(json.dumps({"result": round(float(y.sum()), 6), "compile_s": round(compile_s, 3),
                      "mode": mode}), flush=True)
    notify("READY=1", "STATUS=ready", "X_PHASE=ready")

    def restored() -> None:
        with torch.no_grad():
            y = run(x)
        print(json.dumps({"result": round(float(y.sum()), 6), "compile_s": 0.0,
                          "mode": mode, "restored": True}), flush=True)
        notify("READY=1", "STATUS=ready", "X_PHASE=ready", "X_RESTORED=1")

    on_restore(restored)
    if os.environ.get("COMPILE_EXIT_WHEN_READY") != "1":
        while not stop.wait(3600):
            pass
    notify("STOPPING=1", "STATUS=stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
