"""A config's keys as typed values: a section from a JSON object, a scalar
from command-line text, each error a ConfigError naming the key (and the
closest keys where one is unknown). `jaxtp.config` reads and overrides
through these, and applies `section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from .checks import ConfigError


# keys a stored config may still hold under an earlier name: {old: new}
RENAMED = {"model": {"first_k_dense": "moe_first_dense"}}


def section_from_dict(sub_cls, d, name):
    if not isinstance(d, dict):
        raise ConfigError(f"config section '{name}' must be an object, got {d!r}")
    both = [k for k, new in RENAMED.get(name, {}).items() if k in d and new in d]
    if both:
        raise ConfigError(f"config section '{name}' has both {name}.{both[0]} and its new "
                          f"name {name}.{RENAMED[name][both[0]]}: keep the new one")
    d = {RENAMED.get(name, {}).get(k, k): v for k, v in d.items()}
    fields = {f.name: f for f in dataclasses.fields(sub_cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key(s) {[f'{name}.{k}' for k in unknown]}"
                          f"{did_you_mean(unknown[0], fields, name)}")
    kwargs = {k: check_type(f"{name}.{k}", v, fields[k].type) for k, v in d.items()}
    return sub_cls(**kwargs)


def did_you_mean(name: str, fields, section: str) -> str:
    """'; did you mean ...?' naming the closest keys of `section`, else where
    to find them all (docs/cli.md lists every key)."""
    close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join(f'{section}.{c}' for c in close)}?"
    return (f"; '{section}' has {len(fields)} keys: the fields of "
            f"{section.capitalize()}Config in jaxtp/config.py")


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def check_type(key: str, value: Any, type_name: str) -> Any:
    want = _TYPES[type_name]
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(
            f"{key} must be {type_name}, got {value!r} ({type(value).__name__})"
        )
    return value


def parse_scalar(key: str, text: str, type_name: str) -> Any:
    try:
        if type_name == "bool":
            low = text.lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
        return _TYPES[type_name](text)
    except ValueError:
        raise ConfigError(f"{key}={text!r}: expected a {type_name}") from None


def apply_overrides(cfg, overrides: list[str]):  # (a Config; its own type builds the result)
    """Apply `section.key=value` strings (e.g. `model.d_model=256`)."""
    d = cfg.to_dict()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, text = item.split("=", 1)
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in d:
            raise ConfigError(
                f"override key {key!r} must be <section>.<key> with section in {sorted(d)}"
            )
        section, name = parts
        fields = {f.name: f.type for f in dataclasses.fields(type(getattr(cfg, section)))}
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}'{did_you_mean(name, fields, section)}")
        d[section][name] = parse_scalar(key, text, fields[name])
    return type(cfg).from_dict(d)
