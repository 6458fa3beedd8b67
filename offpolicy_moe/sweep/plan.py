"""Experiment files: a base config, a grid of named axes, seeds -> a list of planned runs (the format is in
docs/sweeps.md, "Experiment files").

Merging for one run: ``base`` < each axis's fragment (in grid order) < ``seed=<s>`` < command-line overrides.
``preset`` lists CONCATENATE (base's first, then the axes'), every other key is replaced by the later layer.
Run folders are named ``<axis>=<label>__...__seed=<s>`` (labels sanitised for file names).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from offpolicy_moe.config.load import deep_merge, load_config_dict, nest_dotted, to_dict
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.report.claims import check_claim_axes
from offpolicy_moe.report.names import SAMPLES_KEY, logs_sampled, sampled_requirement
from offpolicy_moe.report.spec import ReportSpec, metric_names, parse_report

_LABEL_RE = re.compile(r"[^A-Za-z0-9._+\-]+")


@dataclass
class Axis:
    """One grid axis: ordered value labels, each mapped to a config fragment (nested dict)."""

    name: str
    labels: list[str]
    fragments: dict[str, dict]


@dataclass
class Experiment:
    name: str
    description: str
    base: dict
    axes: list[Axis]
    seeds: list[int]
    exclude: list[dict] = field(default_factory=list)
    report: ReportSpec = field(default_factory=ReportSpec)
    source: Optional[Path] = None
    raw: dict = field(default_factory=dict)
    source_name: str = "<experiment>"                   # how errors name the file


@dataclass
class RunSpec:
    """A planned run: its folder name, axis labels, seed, the user-layer dict and the resolved config."""

    name: str
    axes: dict[str, str]
    seed: int
    data: dict
    config: TrainConfig


def sanitize_label(value: Any) -> str:
    """A file-name-safe label for an axis value (``/`` and spaces become ``-``)."""
    s = _LABEL_RE.sub("-", str(value)).strip("-")
    return s or "_"


def load_experiment(path: str | Path) -> Experiment:
    """Parse and check an experiment YAML file (see the module docstring). Errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"experiment file '{p}': not found")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"experiment file '{p}': cannot parse YAML: {exc}") from None
    exp = parse_experiment(raw, source=str(p))
    exp.source = p
    if not raw.get("name"):
        exp.name = p.stem
    return exp


def parse_experiment(raw: Mapping[str, Any], source: str = "<experiment>") -> Experiment:
    """Build an :class:`Experiment` from a dict (the parsed YAML)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a mapping at top level")
    allowed = {"name", "description", "seeds", "base", "grid", "exclude", "report"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    base = raw.get("base") or {}
    if not isinstance(base, Mapping):
        raise ConfigError(f"{source}: 'base' must be a mapping of config keys")
    seeds = raw.get("seeds", [0])
    if isinstance(seeds, int):
        seeds = [seeds]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{source}: 'seeds' must be a non-empty list of integers, got {seeds!r}")
    grid = raw.get("grid") or {}
    if not isinstance(grid, Mapping):
        raise ConfigError(f"{source}: 'grid' must be a mapping of axis name -> values")
    axes = [_parse_axis(str(n), spec, source) for n, spec in grid.items()]
    names = [a.name for a in axes]
    if "seed" in names:
        raise ConfigError(f"{source}: grid axis 'seed' is reserved; use 'seeds:'")
    exclude = raw.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, Mapping) for e in exclude):
        raise ConfigError(f"{source}: 'exclude' must be a list of {{axis: label}} mappings")
    for e in exclude:
        for k, v in e.items():
            ax = next((a for a in axes if a.name == k), None)
            if ax is None:
                raise ConfigError(f"{source}: exclude names unknown axis '{k}' (axes: {', '.join(names)})")
            if sanitize_label(v) not in ax.labels:
                raise ConfigError(f"{source}: exclude: axis '{k}' has no value '{v}' (values: {ax.labels})")
    try:
        report = parse_report(raw.get("report"), source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Experiment(
        name=str(raw.get("name") or "sweep"),
        description=str(raw.get("description") or ""),
        base=nest_dotted(base),
        axes=axes,
        seeds=list(seeds),
        exclude=[{k: sanitize_label(v) for k, v in e.items()} for e in exclude],
        report=report,
        raw=dict(raw),
        source_name=source,
    )


def _parse_axis(name: str, spec: Any, source: str) -> Axis:
    where = f"{source}: grid axis '{name}'"
    if isinstance(spec, Mapping) and set(spec) == {"key", "values"}:
        key, values = spec["key"], spec["values"]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: 'values' must be a non-empty list")
        return _list_axis(name, str(key), values, where)
    if isinstance(spec, list):
        if "." not in name and name not in TrainConfig.__dataclass_fields__:
            raise ConfigError(
                f"{where}: a plain list needs the axis to be named after a config key (e.g. buffer.staleness), "
                "or use {key: ..., values: [...]} / a mapping of label -> fragment"
            )
        return _list_axis(name, name, spec, where)
    if isinstance(spec, Mapping):
        if not spec:
            raise ConfigError(f"{where}: no values")
        labels, frags = [], {}
        for label, frag in spec.items():
            lab = sanitize_label(label)
            if lab in frags:
                raise ConfigError(f"{where}: labels '{label}' collide after sanitising ('{lab}')")
            if frag is None:
                frag = {}
            if not isinstance(frag, Mapping):
                raise ConfigError(f"{where}: value '{label}' must map to a config fragment (a mapping), got {frag!r}")
            labels.append(lab)
            frags[lab] = nest_dotted(frag)
        return Axis(name, labels, frags)
    raise ConfigError(f"{where}: expected a list, {{key, values}} or a mapping of label -> fragment")


def _list_axis(name: str, key: str, values: list, where: str) -> Axis:
    labels, frags = [], {}
    for v in values:
        if isinstance(v, (dict, list)):
            raise ConfigError(f"{where}: list values must be scalars, got {v!r}")
        lab = sanitize_label(v)
        if lab in frags:
            raise ConfigError(f"{where}: duplicate value {v!r}")
        labels.append(lab)
        frags[lab] = nest_dotted({key: v})
    return Axis(name, labels, frags)


def merge_layers(layers: Sequence[Mapping]) -> dict:
    """Merge user-layer dicts in order: ``preset`` lists concatenate, other keys are replaced by later layers."""
    out: dict = {}
    presets: list = []
    for layer in layers:
        layer = dict(layer)
        p = layer.pop("preset", None)
        if p:
            presets.extend([p] if isinstance(p, str) else list(p))
        out = deep_merge(out, layer)
    if presets:
        out["preset"] = presets
    return out


def plan_runs(
    exp: Experiment,
    seeds: Optional[Sequence[int]] = None,
    overrides: Sequence[str] = (),
) -> list[RunSpec]:
    """Every (grid point x seed) not excluded, with its resolved config (unknown keys etc. raise ConfigError)."""
    seeds = list(seeds) if seeds is not None else exp.seeds
    runs: list[RunSpec] = []
    for combo in itertools.product(*[a.labels for a in exp.axes]):
        labels = {a.name: lab for a, lab in zip(exp.axes, combo)}
        if any(all(labels.get(k) == v for k, v in e.items()) for e in exp.exclude):
            continue
        frags = [a.fragments[lab] for a, lab in zip(exp.axes, combo)]
        for seed in seeds:
            # a sweep does not export each run (trainer.export_final) unless the experiment file asks
            data = merge_layers([{"trainer": {"export_final": False}}, exp.base, *frags, {"seed": int(seed)}])
            name = "__".join([f"{sanitize_label(k)}={v}" for k, v in labels.items()] + [f"seed={seed}"])
            cfg = load_config_dict(data, overrides=overrides, source=f"experiment '{exp.name}', run {name}")
            runs.append(RunSpec(name=name, axes=labels, seed=int(seed), data=data, config=cfg))
    if not runs:
        raise ConfigError(f"experiment '{exp.name}': the grid is empty (everything excluded?)")
    return runs


def check_claims(exp: Experiment, runs: Sequence[RunSpec]) -> list[str]:
    """The axis names of ``report.claims`` against the grid (and the planned runs' config keys), before any run
    starts: an unknown axis is a one-line :class:`ConfigError`; a label the grid lacks (the claim will read
    ``no runs``) and fewer than two seeds (every claim will read ``n too small``) are returned as warnings."""
    if not exp.report.claims:
        return []
    try:
        warnings = check_claim_axes(exp.report.claims, {a.name: a.labels for a in exp.axes},
                                    (to_dict(r.config) for r in runs), where=f"{exp.source_name}: report")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    seeds = sorted({r.seed for r in runs})
    if len(seeds) < 2:
        warnings.append(f"{exp.source_name}: report.claims: {len(seeds)} seed ({', '.join(map(str, seeds))}); "
                        f"every claim will read 'n too small' (a t interval needs 2 seeds)")
    return warnings


def check_report_metrics(exp: Experiment, runs: Sequence[RunSpec]) -> list[str]:
    """The sampled metrics the report reads (``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``) against the planned
    runs' ``eval.samples``, before any run starts: a metric that no planned run will log is a one-line
    :class:`ConfigError` naming the entry and the ``eval.samples`` it needs; one that only some runs will log is a
    warning (returned): their cells read ``–``, their claims ``no runs``."""
    samples = {r.name: planned_samples(r) for r in runs}
    warnings: list[str] = []
    for name, entries in metric_names(exp.report).items():
        need = sampled_requirement(name)
        lacking = [n for n, k in samples.items() if need is not None and not logs_sampled(name, k)]
        if not lacking:
            continue
        at = f"{exp.source_name}: {entries[0]}"
        if len(lacking) == len(samples):
            have = ", ".join(str(k) for k in sorted(set(samples.values())))
            raise ConfigError(f"{at}: metric '{name}' is logged only by runs trained with {need}, and no planned run "
                              f"is ({SAMPLES_KEY}: {have}); set it in base: or on the command line")
        more = f", +{len(lacking) - 3} more" if len(lacking) > 3 else ""
        warnings.append(f"{at}: metric '{name}' is logged only by runs trained with {need}; {len(lacking)} of "
                        f"{len(samples)} planned runs are not ({', '.join(lacking[:3])}{more})")
    return warnings


def planned_samples(run: RunSpec) -> int:
    """``eval.samples`` of a planned run's resolved config: held-out samples per problem, 0 (off) when unset."""
    value: Any = to_dict(run.config)
    for part in SAMPLES_KEY.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
