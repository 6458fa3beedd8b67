"""``offpolicy-moe presets [NAME ...]``: list the named algorithms (``algorithms/``) and the mechanisms they compose
(``offpolicy_moe/mechanisms/``), or print NAMEs composed and resolved."""
from __future__ import annotations

import argparse


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
    # the config imports OmegaConf: imported when the command runs, so `offpolicy-moe --help` stays fast
    from offpolicy_moe.config.load import (algorithms_dir, available_presets, load_config, mechanisms_dir,
                                           preset_description, to_dict, to_yaml)

    if not args.names:
        presets = available_presets()
        width = max((len(n) for n in presets), default=0)
        algorithms = {p.stem: p for p in sorted(algorithms_dir().glob("*.yaml"))}
        shelves = [(f"algorithms ({algorithms_dir()}): train one with `offpolicy-moe train --preset NAME` (or the file itself)",
                    algorithms),
                   ("mechanisms (single-mechanism fragments the algorithms compose)",
                    {n: p for n, p in presets.items() if p.parent == mechanisms_dir()}),
                   ("your own (from $OFFPOLICY_MOE_PRESETS)",
                    {n: p for n, p in presets.items() if p.parent not in (mechanisms_dir(), algorithms_dir())})]
        for title, shelf in shelves:
            if shelf:
                print(title)
                for name, path in shelf.items():
                    print(f"  {name:<{width}}  {preset_description(path)}")
        print("\ncompose presets with `preset: [m2po, tis, r3]` in a config, or `offpolicy-moe presets m2po tis r3` "
              "to see the result")
        return 0
    cfg = load_config(presets=args.names)          # an unknown preset: ConfigError, one line from the CLI
    if args.changed:
        for k, v in _diff(to_dict(cfg), to_dict(load_config())).items():
            print(f"{k}: {v}")
    else:
        print(to_yaml(cfg), end="")
    return 0
