"""Long-run fuzzing: the properties of tests/unit/fuzz, with many more examples than the tests.

Targets and their properties (each written once, in its test module, listed in its
``PROPERTIES``):

* ``layers``      footer and TOC parsing, and reading (tests/unit/fuzz/test_fuzz_layers.py)
* ``tar``         the converter's tar input (tests/unit/fuzz/test_fuzz_tar_input.py)
* ``control``     the FUSE server's control-socket protocol (test_fuzz_control.py)
* ``safetensors`` safetensors headers, against the reference reader too (test_fuzz_safetensors.py)

Each property runs in rounds of ``--batch`` examples, each round with its own seed (printed: a
run can be repeated with ``--seed``), until its share of ``--minutes`` (a target's minutes are
split among its properties) or its ``--examples`` are spent. A failure is shrunk by hypothesis
to a minimal input and printed with it; the property then stops (its next failure would most
likely be the same one). A memory limit (``--max-memory-gb``) turns a huge allocation into a
MemoryError, i.e. a finding; an example over 30 s is a hang, a finding too.

    .venv/bin/python bench/fuzz.py --minutes 10                  # every target, 10 min each
    .venv/bin/python bench/fuzz.py --examples 5000 --target layers
    .venv/bin/python bench/fuzz.py --list

Prints one line per property (examples run, seconds, outcome counts, findings), then each
finding with its reproducer; ``--json PATH`` writes the same. Exits 1 when anything was found.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, seed, settings

from tests.unit.fuzz import (
    common,
    test_fuzz_control,
    test_fuzz_layers,
    test_fuzz_safetensors,
    test_fuzz_tar_input,
)

TARGETS: dict[str, list[common.Property]] = {
    "layers": test_fuzz_layers.PROPERTIES,
    "tar": test_fuzz_tar_input.PROPERTIES,
    "control": test_fuzz_control.PROPERTIES,
    "safetensors": test_fuzz_safetensors.PROPERTIES,
}


@dataclass
class Finding:
    """One failure: what was raised, where, and the minimal input hypothesis shrank it to."""

    error: str
    where: str
    reproducer: str
    seed: int


@dataclass
class Run:
    """What one property's run did."""

    target: str
    property: str
    examples: int = 0
    seconds: float = 0.0
    rounds: int = 0
    seeds: list[int] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)


def _findings(exc: BaseException, round_seed: int) -> list[Finding]:
    out = []
    for sub in getattr(exc, "exceptions", None) or [exc]:
        frames = traceback.extract_tb(sub.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        out.append(Finding(error=f"{type(sub).__name__}: {str(sub)[:500]}", where=where,
                           reproducer="\n".join(getattr(sub, "__notes__", [])), seed=round_seed))
    return out


def run_property(target: str, prop: common.Property, *, seconds: float | None,
                 examples: int | None, batch: int, rng: random.Random) -> Run:
    """Run ``prop`` until its time or example budget is spent, or it fails."""
    run = Run(target, prop.name)
    calls = 0

    def counted(case: Any) -> None:
        nonlocal calls
        calls += 1
        prop.check(case)

    counted.__name__ = counted.__qualname__ = prop.check.__name__   # names the reproducer
    common.OUTCOMES.clear()
    start = time.monotonic()
    while True:
        left = None if examples is None else examples - calls
        if left is not None and left <= 0:
            break
        if seconds is not None and time.monotonic() - start >= seconds:
            break
        round_seed = rng.randrange(2**32)
        run.seeds.append(round_seed)
        n = batch if left is None else min(batch, left)
        bounded = settings(max_examples=n, deadline=None, database=None, derandomize=False,
                           suppress_health_check=list(HealthCheck), print_blob=False)
        test = given(prop.strategy())(counted)   # a fresh test: settings apply once each
        try:
            seed(round_seed)(bounded(test))()
        except Exception as exc:
            run.findings = _findings(exc, round_seed)
        run.rounds += 1
        if run.findings:
            break
    run.examples = calls
    run.seconds = time.monotonic() - start
    run.outcomes = dict(common.OUTCOMES.most_common())
    return run


def _limit_memory(gib: float) -> None:
    limit = int(gib * (1 << 30))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", choices=sorted(TARGETS),
                    help="a target to fuzz (repeatable; default: all)")
    ap.add_argument("--property", action="append", metavar="NAME",
                    help="only this property (repeatable; see --list)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="minutes per target (default 1)")
    budget.add_argument("--examples", type=int, help="examples per property")
    ap.add_argument("--batch", type=int, default=200,
                    help="examples per round, each round with its own seed (%(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the round seeds")
    ap.add_argument("--max-memory-gb", type=float, default=4.0,
                    help="address-space limit; a larger allocation is a finding (%(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--list", action="store_true", help="list targets and properties")
    args = ap.parse_args()
    if args.list:
        for name, props in TARGETS.items():
            print(f"{name}: {', '.join(p.name for p in props)}")
        return 0
    base_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(base_seed)
    if args.max_memory_gb > 0:
        _limit_memory(args.max_memory_gb)
    minutes = args.minutes if args.minutes is not None or args.examples else 1.0
    print(f"seed {base_seed}; "
          + (f"{args.examples} examples per property" if args.examples
             else f"{minutes:g} min per target")
          + f"; memory limit {args.max_memory_gb:g} GiB", flush=True)
    runs: list[Run] = []
    for target in args.target or list(TARGETS):
        props = [p for p in TARGETS[target] if not args.property or p.name in args.property]
        for prop in props:
            share = None if args.examples else minutes * 60 / len(props)
            run = run_property(target, prop, seconds=share, examples=args.examples,
                               batch=args.batch, rng=rng)
            runs.append(run)
            outcomes = ", ".join(f"{k.split(': ', 1)[-1]} {v}" for k, v in run.outcomes.items())
            print(f"{target:<12} {prop.name:<24} {run.examples:>8} examples {run.seconds:>8.1f} s"
                  f"  findings {len(run.findings)}  [{outcomes}]", flush=True)
    found = [(r, f) for r in runs for f in r.findings]
    total = sum(r.examples for r in runs)
    print(f"\n{total} examples in {sum(r.seconds for r in runs):.1f} s, "
          f"{len(found)} finding(s)")
    for r, f in found:
        print(f"\n== {r.target}/{r.property} (round seed {f.seed}): {f.error}\n   at {f.where}")
        print("   " + f.reproducer.replace("\n", "\n   "))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "seed": base_seed, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "runs": [r.__dict__ | {"findings": [f.__dict__ for f in r.findings]} for r in runs],
        }, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
