"""Setting up a node: containerd's config, the systemd unit, and what is installed.

- :mod:`~coldstart.node.containerd_config`: our keys in containerd's ``config.toml`` (schemas 2
  and 3), put in and taken out with tomlkit, comments and layout kept.
- :mod:`~coldstart.node.systemd`: the ``coldstart-snapshotter.service`` unit and systemctl.
- :mod:`~coldstart.node.state`: what install did (backup, changed keys, checksums).
- :mod:`~coldstart.node.install`: install and uninstall as plans of file changes.
- :mod:`~coldstart.node.status`: what is installed and whether containerd and the FUSE server
  see it.

Example::

    from coldstart.node.install import NodePaths, plan_install
    plan = plan_install(NodePaths())
    print(plan.diff())
"""
