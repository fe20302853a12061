"""``python3 -m coldstart.warmup …``: the ``coldstart warmup`` commands, for images that ship
the coldstart package without its console script."""

from coldstart.commands._common import add_common_options
from coldstart.commands.warmup import warmup

if __name__ == "__main__":
    add_common_options(warmup)(prog_name="coldstart warmup")
