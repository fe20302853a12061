"""coldstart.benchmark."""

#: ``coldstart bench --settle``'s default: the rest after each drop of the page cache. On a VM
#: with free page reporting the pages a run frees go back to the host about two seconds later,
#: and the next run's reads then wait on host page faults; 6 s lets every run (and the floor,
#: right after its own full pull) start from that settled state, whatever ran before it
#: (bench/bench_weights.py waits the same).
SETTLE_S = 6.0
#: ``coldstart bench --memory hot``: the anonymous memory written and freed after each rest, at
#: most (and at most half of what the kernel says is available, or of the memory cgroup's room:
#: ``coldstart.benchmark.node.hot_memory_bytes``), so that what the run allocates first (the
#: page cache it fills, the app's heap) is still backed by the host
HOT_MEMORY_BYTES = 3 << 30
