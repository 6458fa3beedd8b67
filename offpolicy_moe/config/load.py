"""Loading a run configuration: schema defaults < presets (in order) < the user's YAML < ``key=value``.

The schema is :class:`offpolicy_moe.config.schema.TrainConfig` (typed dataclasses). Merging goes through
OmegaConf structured configs, which reject unknown keys with a "Did you mean ...?" suggestion, check types,
and parse ``3e-4`` as a float (plain PyYAML reads it as a string). Every error is re-raised as
:class:`ConfigError` naming the source (preset file, config file or override) and the dotted key.

Presets are YAML fragments shipped as package data in ``offpolicy_moe/presets/`` (one per algorithm or mechanism),
or in the folders listed in the environment variable ``OFFPOLICY_MOE_PRESETS`` (``os.pathsep``-separated, searched
first). A preset may itself list ``preset: [...]``: those are expanded first (depth-first, in order), then the
preset's own keys; cycles are refused. A preset named twice is applied twice, at both positions.

Where the preset names come from, in order: the YAML's ``preset:`` list (replaced by a ``preset=[...]`` override
if one is given), then the ``presets`` argument (the CLI's ``--preset``). The final ``cfg.preset`` records that
list, so re-loading a saved ``config.yaml`` gives the same config (all its keys are explicit and win over presets).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.resources
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import ConfigError

PRESETS_ENV = "OFFPOLICY_MOE_PRESETS"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


# ----------------------------------------------------------------------------------------------- presets
def mechanisms_dir() -> Path:
    """The single-mechanism fragments (``grpo``, ``tis``, ``r3``, ...): package data in ``offpolicy_moe/mechanisms/``."""
    return Path(str(importlib.resources.files("offpolicy_moe") / "mechanisms"))


def algorithms_dir() -> Path:
    """The named combinations (``grpo_tis_r3``, ``m2po_r3``, ...): the repository's top-level ``algorithms/``, shipped
    in the wheel as the package ``offpolicy_moe.algorithms``."""
    return Path(str(importlib.resources.files("offpolicy_moe.algorithms")))


def preset_dirs() -> list[Path]:
    """Folders searched for ``<name>.yaml`` presets: ``$OFFPOLICY_MOE_PRESETS`` entries, then the package's
    mechanisms, then its algorithms (a name that is both, e.g. ``grpo``, is the mechanism: the algorithm of that
    name is the mechanism alone).  Both are located through :mod:`importlib.resources`, so editable installs, wheels
    and ``pip install git+...`` find the same files."""
    dirs = [Path(p) for p in os.environ.get(PRESETS_ENV, "").split(os.pathsep) if p]
    return dirs + [mechanisms_dir(), algorithms_dir()]


def available_presets() -> dict[str, Path]:
    """Map preset name -> YAML file; earlier folders in :func:`preset_dirs` shadow later ones."""
    found: dict[str, Path] = {}
    for d in preset_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return dict(sorted(found.items()))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name`` (a bare name, or a path to a ``.yaml`` file)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"preset: a preset name must be a non-empty string, got {name!r}")
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        p = Path(name)
        if not p.is_file():
            raise ConfigError(f"preset: file '{name}' does not exist")
        return p
    presets = available_presets()
    if name not in presets:
        import difflib

        close = difflib.get_close_matches(name, presets, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(
            f"preset: unknown preset '{name}'.{hint} Available: {', '.join(presets) or '(none)'} "
            f"(searched {', '.join(str(d) for d in preset_dirs())}; set ${PRESETS_ENV} to add folders)"
        )
    return presets[name]


def preset_description(name_or_path: str | Path) -> str:
    """First line of the preset's leading comment block (its one-line description)."""
    p = Path(name_or_path) if isinstance(name_or_path, Path) else preset_path(name_or_path)
    for line in p.read_text().splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith("#"):
            break
        text = s.lstrip("#").strip()
        if text:
            return text
    return ""


def expand_presets(names: Sequence[str], _stack: tuple[str, ...] = ()) -> list[tuple[str, DictConfig]]:
    """Ordered ``(source, fragment)`` pairs for preset ``names``: nested ``preset:`` lists first, then own keys.

    Raises :class:`ConfigError` on an unknown preset, a cycle (naming the chain) or a malformed file.
    """
    out: list[tuple[str, DictConfig]] = []
    for name in _as_name_list(names, "preset"):
        if name in _stack:
            chain = " -> ".join((*_stack, name))
            raise ConfigError(f"preset: cycle in preset composition: {chain}")
        path = preset_path(name)
        frag = _load_yaml(path, f"preset '{name}' ({path})")
        nested = frag.pop("preset") if "preset" in frag else []
        out.extend(expand_presets(_as_name_list(nested, f"preset '{name}' ({path}): preset"), (*_stack, name)))
        out.append((f"preset '{name}' ({path})", frag))
    return out


# ----------------------------------------------------------------------------------------------- loading
def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """Split ``key=value`` strings (a leading ``+`` is accepted, as in Hydra) into ``(key, value)`` pairs."""
    pairs = []
    for ov in overrides:
        if not isinstance(ov, str) or "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value (e.g. algo.loss.options.clip_high=0.28)")
        key, value = ov.split("=", 1)
        key = key.strip()
        if key.startswith("+"):
            key = key[1:]
        if key.startswith("~"):
            raise ConfigError(f"override {ov!r}: deleting keys (~key) is not supported; every key has a default")
        if not _KEY_RE.match(key):
            raise ConfigError(f"override {ov!r}: '{key}' is not a dotted key name")
        pairs.append((key, value))
    return pairs


def load_config(
    path: Optional[str | os.PathLike] = None,
    overrides: Sequence[str] = (),
    presets: Sequence[str] = (),
) -> TrainConfig:
    """Resolve a :class:`TrainConfig`: schema defaults < presets (in order) < YAML at ``path`` < ``overrides``.

    ``overrides`` are ``key=value`` strings (``algo.loss.options.clip_low=3e-4``, ``preset=[m2po,r3]``). ``presets`` are
    extra preset names applied after the YAML's own ``preset:`` list. Unknown keys, wrong types and unknown
    presets raise :class:`ConfigError` naming the file or override and the key. Cross-field rules are checked
    separately by :func:`offpolicy_moe.config.validate.validate`.
    """
    user = _load_yaml(Path(path), f"config file '{path}'") if path is not None else OmegaConf.create({})
    return _resolve(user, f"config file '{path}'" if path is not None else "<none>", overrides, presets)


def load_config_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    presets: Sequence[str] = (),
    source: str = "<dict>",
) -> TrainConfig:
    """Like :func:`load_config`, with the user layer given as a (possibly dotted-key) dict instead of a file."""
    try:
        user = OmegaConf.create(nest_dotted(data))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_exc_text(exc)}") from None
    return _resolve(user, source, overrides, presets)


def _resolve(user: DictConfig, source: str, overrides: Sequence[str], presets: Sequence[str]) -> TrainConfig:
    pairs = parse_overrides(overrides)
    names = _as_name_list(user.pop("preset") if "preset" in user else [], f"{source}: preset")
    rest = []
    for key, value in pairs:
        if key == "preset":  # the preset list itself: replaces the YAML's list
            parsed = OmegaConf.from_dotlist([f"preset={value}"]).preset
            names = _as_name_list(parsed, f"override 'preset={value}'")
        else:
            rest.append((key, value))
    names = names + _as_name_list(list(presets), "--preset")

    cfg = _schema_defaults()
    for src, frag in expand_presets(names):
        cfg = _merge(cfg, frag, src)
    cfg = _merge(cfg, user, source)
    for key, value in rest:
        try:
            frag = OmegaConf.from_dotlist([f"{key}={value}"])
        except yaml.YAMLError:   # not YAML (e.g. `task.operators=*`, read as an alias): take the text as written
            frag = OmegaConf.create(nest_dotted({key: value}))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override '{key}={value}': {_exc_text(exc)}") from None
        cfg = _merge(cfg, frag, f"override '{key}={value}'")
    cfg.preset = names
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_exc_text(exc)}") from None
    assert isinstance(obj, TrainConfig)
    return obj


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML text (every key explicit; loads back to an equal config)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain nested dicts/lists (tuples become lists)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def save_resolved(cfg: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``<run_dir>/config.yaml`` atomically (temp file + rename); create the folder. Returns the path."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    dest = d / "config.yaml"
    tmp = d / ".config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, dest)
    return dest


def config_get(cfg: TrainConfig | Mapping, dotted: str) -> Any:
    """Value at a dotted key of a config dataclass or nested dict; ``KeyError`` naming the key if absent."""
    cur: Any = cfg
    for part in dotted.split("."):
        if dataclasses.is_dataclass(cur) and not isinstance(cur, type):
            if not hasattr(cur, part):
                raise KeyError(dotted)
            cur = getattr(cur, part)
        elif isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(dotted)
    return cur


def nest_dotted(data: Mapping[str, Any]) -> dict:
    """``{"a.b": 1, "a": {"c": 2}}`` -> ``{"a": {"b": 1, "c": 2}}`` (recursively; later keys win)."""
    out: dict = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            value = nest_dotted(value)
        parts = str(key).split(".")
        cur = out
        for p in parts[:-1]:
            nxt = cur.get(p)
            if not isinstance(nxt, dict):
                nxt = cur[p] = {}
            cur = nxt
        leaf = parts[-1]
        if isinstance(value, dict) and isinstance(cur.get(leaf), dict):
            cur[leaf] = deep_merge(cur[leaf], value)
        else:
            cur[leaf] = value
    return out


def deep_merge(a: Mapping, b: Mapping) -> dict:
    """Recursive dict merge, ``b`` wins on leaves (lists are replaced, not concatenated)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=1)
def _schema_template() -> DictConfig:
    node = OmegaConf.structured(TrainConfig)  # slow (~10x a copy): built once, kept read-only
    OmegaConf.set_readonly(node, True)
    return node


def _schema_defaults() -> DictConfig:
    """A fresh, writable structured config holding the schema defaults."""
    node = copy.deepcopy(_schema_template())
    OmegaConf.set_readonly(node, None)
    return node


def _load_yaml(path: Path, source: str) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"{source}: file not found")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError, OmegaConf errors
        raise ConfigError(f"{source}: cannot parse YAML: {exc}") from None
    if node is None or (isinstance(node, ListConfig)):
        if node is None:
            return OmegaConf.create({})
        raise ConfigError(f"{source}: expected a mapping of config keys at top level, got a list")
    # dotted keys at any level ("trainer.steps: 5") are accepted and nested
    if any("." in str(k) for k in _all_keys(node)):
        node = OmegaConf.create(nest_dotted(OmegaConf.to_container(node)))
    return node


def _all_keys(node: Any):
    if isinstance(node, DictConfig):
        for k in node.keys():
            yield k
            yield from _all_keys(node._get_node(k))


def _merge(cfg: DictConfig, frag: DictConfig, source: str) -> DictConfig:
    try:  # in place: no deep copy of the growing config per layer (errors abort the whole load anyway)
        return OmegaConf.unsafe_merge(cfg, frag)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_exc_text(exc)}") from None


def _exc_text(exc: OmegaConfBaseException) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    msg = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    key = getattr(exc, "full_key", None)
    return f"key '{key}': {msg}" if key else msg


def _as_name_list(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()] if "," in value else [value]
    if isinstance(value, (list, tuple, ListConfig)):
        names = list(value)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ConfigError(f"{what}: preset names must be non-empty strings, got {n!r}")
        return names
    raise ConfigError(f"{what}: expected a list of preset names, got {value!r}")
