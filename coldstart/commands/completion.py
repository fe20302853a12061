"""``coldstart completion bash|zsh|fish``: the shell completion script (kubectl's spelling)."""

from __future__ import annotations

import click

__all__ = ["completion"]

_EPILOG = """\b
Load it in the current shell, or install it for every new one:
  bash:  source <(coldstart completion bash)
         coldstart completion bash > /etc/bash_completion.d/coldstart
  zsh:   source <(coldstart completion zsh)
         coldstart completion zsh > "${fpath[1]}/_coldstart"
  fish:  coldstart completion fish > ~/.config/fish/completions/coldstart.fish
Commands, subcommands, options and choices complete; so do paths where a path is expected.
"""


@click.command(epilog=_EPILOG)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script of SHELL for coldstart."""
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root()
    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(root.command, {}, root.info_name or "coldstart",
                   "_COLDSTART_COMPLETE").source())
