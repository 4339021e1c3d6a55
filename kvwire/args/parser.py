"""A service's argparse parser generated from its sections' fields, and ``--config FILE``."""
from __future__ import annotations

import argparse
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvwire import envs
from kvwire.args.engine_args import GROUP_TITLES, SERVICES, EngineArgs, service_flags
from kvwire.args.sections import PeerArgs, base_type
ENUMS = enum.Enum  # every enum-typed field is a flag with choices


def _env_name(cls: type, f: dataclasses.Field, peer: str | None) -> str | None:
    if cls is PeerArgs:
        return f"KVWIRE_{peer.upper()}_{f.name.upper()}"
    return f.metadata.get("env")


def make_parser(service: str, description: str | None = None,
                env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The service's parser, generated from the sections' fields (``env``: the variables' mapping, e.g.
    {} for documentation; default os.environ through kvwire.envs)."""
    spec = SERVICES[service]
    ap = argparse.ArgumentParser(prog=spec.prog, description=description)
    ap.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="TOML file of flags (keys: flag names, optionally under section tables); "
                         "flags given here override it")
    groups: dict[str, Any] = {}
    for section, cls, f, dest in service_flags(service):
        if section not in groups:
            groups[section] = ap.add_argument_group(GROUP_TITLES[section].format(peer=spec.peer))
        kind = base_type(cls, f.name)
        default = spec.defaults.get(dest, f.default)
        help_ = spec.help.get(dest, f.metadata["help"]).format(peer=spec.peer)
        kw: dict[str, Any] = dict(dest=dest, metavar=f.metadata["metavar"])
        var = _env_name(cls, f, spec.peer)
        if var is not None:
            help_ += f" [{var}]"
            if envs.is_set(var, env):
                default = envs.get(var, env)
        if isinstance(default, ENUMS):
            default = default.value
        if kind is bool:
            kw.pop("metavar")
            kw["action"] = "store_true" if f.metadata["store_true"] else argparse.BooleanOptionalAction
        elif isinstance(kind, type) and issubclass(kind, ENUMS):
            kw["choices"] = [m.value for m in kind]
        else:
            kw["type"] = kind
        groups[section].add_argument("--" + dest.replace("_", "-"), default=default, help=help_, **kw)
    return ap


def apply_config_file(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    """``--config FILE``: its keys become the parser's defaults, so flags on the command line win.
    Keys are flag names (dashes or underscores), at the top or under a section table
    (``[speculative]``); an unknown key or a wrong value is an argparse error naming it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    path = pre.parse_known_args(argv)[0].config
    if path is None:
        return
    import tomllib  # Python 3.11+: imported only when a --config is given

    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        ap.error(f"--config {path}: {e}")
    actions = {a.dest: a for a in ap._actions if a.option_strings and a.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in _flatten(table, set(GROUP_TITLES)):
        dest = key.replace("-", "_")
        if dest not in actions:
            ap.error(f"--config {path}: unknown key {key!r} (not a flag of {ap.prog})")
        values[dest] = _config_value(ap, path, key, actions[dest], value)
    ap.set_defaults(**values)


def _flatten(table: Mapping[str, Any], sections: set[str]) -> list[tuple[str, Any]]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict) and key.replace("-", "_") in sections:
            out += [(k, v) for k, v in value.items()]
        else:
            out.append((key, value))
    return out


def _config_value(ap: argparse.ArgumentParser, path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    bad = f"--config {path}: {key} = {value!r}"
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # a switch
        if not isinstance(value, bool):
            ap.error(f"{bad}: expected true or false")
        return value
    if isinstance(value, (dict, list, bool)):
        ap.error(f"{bad}: expected a single value")
    try:
        value = action.type(value) if action.type is not None else str(value)
    except (TypeError, ValueError):
        ap.error(f"{bad}: expected {getattr(action.type, '__name__', 'a value')}")
    if action.choices is not None and value not in action.choices:
        ap.error(f"{bad}: choose from {', '.join(map(str, action.choices))}")
    return value


def parse_args(service: str, argv: Sequence[str] | None = None, description: str | None = None) -> EngineArgs:
    """Parse a service's command line (and its --config file); errors exit as argparse's do."""
    ap = make_parser(service, description)
    apply_config_file(ap, argv)
    ns = ap.parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if k != "config"}
    try:
        return EngineArgs.from_values(values, service)
    except ValueError as e:
        ap.error(str(e))
