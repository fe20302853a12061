"""coldstart.benchmark."""

#: ``coldstart bench --settle``'s default: the rest after each drop of the page cache. On a VM
#: with free page reporting the pages a run frees go back to the host about two seconds later,
#: and the next run's reads then wait on host page faults; 6 s lets every run (and the floor,
#: right after its own full pull) start from that settled state, whatever ran before it
#: (bench/bench_weights.py waits the same).
SETTLE_S = 6.0
