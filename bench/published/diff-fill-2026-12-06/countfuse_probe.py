# temporary measurement aid (not part of the product): counts FUSE requests by opcode in
# processes started with COLDSTART_COUNT_FUSE=DIR, written to DIR/fuse-<pid>.json
import os
if os.environ.get("COLDSTART_COUNT_FUSE"):
    import atexit, collections, json, threading, time
    out = os.path.join(os.environ["COLDSTART_COUNT_FUSE"], f"fuse-{os.getpid()}.json")
    counts = collections.Counter()
    def dump():
        with open(out + ".tmp", "w") as f: json.dump(dict(counts), f)
        os.replace(out + ".tmp", out)
    def loop():
        while True:
            time.sleep(0.5); dump()
    def install():
        try:
            from coldstart.lazyfs import fusewire
        except Exception:
            return
        orig = fusewire.FuseSession.__init__
        def init(self, *a, **k):
            orig(self, *a, **k)
            tag = "plain" if not self.xattrs else "full"
            for op, fn in list(self._dispatch.items()):
                def wrap(u, n, b, fn=fn, key=f"{tag}:{op}"):
                    counts[key] += 1
                    if op == fusewire.GETXATTR:
                        raw = bytes(b[8:]); counts[f"{tag}:x:" + raw.split(b"\0")[0].decode(errors="replace")] += 1
                    return fn(u, n, b)
                self._dispatch[op] = wrap
        fusewire.FuseSession.__init__ = init
        threading.Thread(target=loop, daemon=True).start()
    import importlib.abc, sys
    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "coldstart.lazyfs.fusewire":
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                loader = spec.loader
                orig_exec = loader.exec_module
                def exec_module(module):
                    orig_exec(module)
                    install_after(module)
                loader.exec_module = exec_module
                return spec
            return None
    import importlib.util
    def install_after(module):
        sys.modules["coldstart.lazyfs.fusewire"] = module
        install()
    sys.meta_path.insert(0, Hook())
