"""``offpolicy-moe presets [NAME ...]``: list the algorithm presets, or print NAMEs composed and resolved."""
from __future__ import annotations

import argparse

from offpolicy_moe.config import available_presets, load_config, preset_description, to_dict, to_yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="presets to compose in order (e.g. m2po tis r3); none: list every preset")
    p.add_argument("--changed", action="store_true",
                   help="print only the keys that differ from the schema defaults")


def _diff(a, b, prefix=""):
    out = {}
    for k, v in a.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(b.get(k), dict):
            out.update(_diff(v, b[k], key + "."))
        elif b.get(k) != v:
            out[key] = v
    return out


def run(args: argparse.Namespace) -> int:
    if not args.names:
        presets = available_presets()
        width = max((len(n) for n in presets), default=0)
        for name, path in presets.items():
            print(f"{name:<{width}}  {preset_description(path)}")
        print(f"\n{len(presets)} presets; compose them with `preset: [m2po, tis, r3]` in a config, "
              "or `offpolicy-moe presets m2po tis r3` to see the result.")
        return 0
    cfg = load_config(presets=args.names)          # an unknown preset: ConfigError, one line from the CLI
    if args.changed:
        for k, v in _diff(to_dict(cfg), to_dict(load_config())).items():
            print(f"{k}: {v}")
    else:
        print(to_yaml(cfg), end="")
    return 0
