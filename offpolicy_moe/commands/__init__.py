"""Subcommands of ``offpolicy-moe``; each module exposes ``add_arguments`` and ``run``."""
