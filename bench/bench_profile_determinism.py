"""Are start-up profiles deterministic enough to be useful? Record the torch image's start-up
``--recordings`` times (each on a fresh private node, ``coldstart optimize``'s recorder) and
report how many files each pair of recordings shares (shared / either, per layer and path), and
how many bytes of the recorded ranges. Needs root.

    .venv/bin/python bench/bench_profile_determinism.py [--recordings 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from coldstart.benchmark import images
from coldstart.benchmark.optimize import OptimizeOptions, record_profile
from coldstart.prefetch.profile import file_overlap, profile_paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", default="torch")
    ap.add_argument("--recordings", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("bench/results/profile-determinism.json"))
    args = ap.parse_args()
    img = images.load_image(args.image, None) or images.build_image(args.image, None)
    src = f"oci:{img.layout}:latest"
    opts = OptimizeOptions(command=list(img.command), env=list(img.env), ready=img.ready)
    profiles = []
    for i in range(args.recordings):
        p = record_profile(src, opts)
        print(f"recording {i + 1}: {p.files} files, ready after {p.seconds:.2f} s", flush=True)
        profiles.append(p)
    pairs = []
    for a, b in itertools.combinations(range(len(profiles)), 2):
        shared = file_overlap(profile_paths(profiles[a]), profile_paths(profiles[b]))
        pairs.append({"a": a, "b": b, "shared_files": shared})
        print(f"recordings {a + 1} and {b + 1} share {100 * shared:.1f} % of their files "
              f"(goal >= 95 %)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "image": args.image,
        "recordings": [{"files": p.files, "ready_s": p.seconds} for p in profiles],
        "pairs": pairs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
