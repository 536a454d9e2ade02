"""The command line: `--preset=NAME` first, then checked `--key=value` / `--section.key=value` overrides.

Each token is typed by the dataclass field it names (config.py); an unknown key fails with the closest valid key
in the message, a bad value names the type it expected. A repeated key, --preset included: the last one wins.
parse_args returns a checked Config (Config.check); parse_flags does the same typing for the scripts' flat
argument dataclasses (sample.py, eval.py, rl.py, tasks.py). help_text is what `python train.py --help` prints.

    cfg = parse_args(["--preset=tiny", "--train.steps=50", "--model.n_layer=2"])

Tested by tests/test_config.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import keyword
import json

from nanopara.config import Config, ConfigError
from nanopara.presets import PRESETS


BARE_FLAGS = ("resume", "overwrite", "plan")  # --resume means --resume=true


def _parse_value(text: str, typ, key: str):
    if typ in (bool, "bool"):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{key} expects true/false, got {text!r}")
    try:
        if typ in (int, "int"):
            return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text)
        if typ in (float, "float"):
            return float(text)
    except ValueError:
        raise ConfigError(f"--{key} expects {getattr(typ, '__name__', typ)}, got {text!r}") from None
    return text


def _valid_keys(cfg: Config) -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if dataclasses.is_dataclass(val):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(val)]
        else:
            keys.append(f.name)
    return keys


def apply_override(cfg: Config, key: str, text: str) -> None:
    parts = [f"{k}_" if keyword.iskeyword(k) else k for k in key.split(".")]  # --ckpt.async: the field async_
    target, name = (cfg, parts[0]) if len(parts) == 1 else (getattr(cfg, parts[0], None), parts[1])
    ok = len(parts) <= 2 and target is not None and dataclasses.is_dataclass(target) and \
        name in {f.name for f in dataclasses.fields(target)} and not dataclasses.is_dataclass(getattr(target, name))
    if not ok:
        close = difflib.get_close_matches(key, _valid_keys(cfg), n=1, cutoff=0.5)
        hint = f" (did you mean --{close[0]}?)" if close else ""
        raise ConfigError(f"unknown config key --{key}{hint}")
    typ = {f.name: f.type for f in dataclasses.fields(target)}[name]
    setattr(target, name, _parse_value(text, typ, key))


def parse_args(argv: list[str]) -> Config:
    """One rule for a repeated key, --preset included: the last one wins, as in shells and most CLIs."""
    pairs = []
    for tok in argv:
        if tok.startswith("--") and tok[2:] in BARE_FLAGS:
            tok += "=true"
        if not tok.startswith("--") or "=" not in tok:
            raise ConfigError(f"arguments look like --key=value, got {tok!r}")
        key, _, val = tok[2:].partition("=")
        pairs.append((key, val))
    presets = [v for k, v in pairs if k == "preset"]
    preset = presets[-1] if presets else "gpt2_124m"
    if preset not in PRESETS:
        close = difflib.get_close_matches(preset, PRESETS, n=1)
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    cfg = PRESETS[preset]()
    for key, val in pairs:
        if key != "preset":
            apply_override(cfg, key, val)
    cfg.check()
    return cfg


def parse_flags(obj, argv: list[str], error=ConfigError):
    """Set `--key=value` tokens on a flat dataclass instance (the scripts' arguments: sample.py, eval.py): typed by
    the field (int, float, str), the last one wins, an unknown key names the closest one. Raises `error`."""
    fields = {f.name: f.type for f in dataclasses.fields(obj)}
    for tok in argv:
        if not tok.startswith("--") or "=" not in tok:
            raise error(f"arguments look like --key=value, got {tok!r}")
        key, _, text = tok[2:].partition("=")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            raise error(f"unknown key --{key}" + (f" (did you mean --{close[0]}?)" if close else ""))
        typ = {"int": int, "float": float}.get(fields[key] if isinstance(fields[key], str) else fields[key].__name__)
        try:
            setattr(obj, key, typ(text) if typ else text)
        except ValueError:
            raise error(f"--{key} expects {'an integer' if typ is int else 'a number'}, got {text!r}") from None
    return obj


def help_text() -> str:
    """Every key with its default and the comment beside its field: what `python train.py --help` prints."""
    import inspect
    import re
    cfg, lines = Config(), ["usage: python train.py [--preset=NAME] [--section.key=value ...]  (a repeated key: the "
                            f"last one wins)", f"presets: {', '.join(PRESETS)}", ""]
    for cls, prefix in [(Config, "")] + [(type(getattr(cfg, f.name)), f.name + ".") for f in dataclasses.fields(cfg)
                                         if dataclasses.is_dataclass(getattr(cfg, f.name))]:
        notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
        obj = cfg if not prefix else getattr(cfg, prefix[:-1])
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(getattr(obj, f.name)):
                lines.append(f"  {f'--{prefix}{f.name}={getattr(obj, f.name)}':<40} {notes.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def config_from_dict(d: dict) -> Config:
    """Inverse of Config.to_dict (used to read a checkpoint's config back)."""
    cfg = Config()
    for k, v in d.items():
        sub = getattr(cfg, k)
        if dataclasses.is_dataclass(sub):
            for kk, vv in v.items():
                setattr(sub, kk, vv)
        else:
            setattr(cfg, k, v)
    return cfg


def describe(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=1)
