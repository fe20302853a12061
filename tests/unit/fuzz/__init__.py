"""Property-based fuzzers (hypothesis) for the parsers that read untrusted bytes.

Each module holds its strategies, its property functions (``check_*``) and a bounded test per
property; :data:`PROPERTIES` in each module lists them for ``bench/fuzz.py``, which runs the same
properties for longer. ``COLDSTART_FUZZ_EXAMPLES=N`` raises every bounded test to N examples.
"""
