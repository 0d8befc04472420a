"""Typed service configs: one dataclass per service, from which its command line and its
environment variables are generated (as vLLM builds its CLI from EngineArgs' fields).

An option is a dataclass field made by `option(default, help, env=..., check=...)`:

    @dataclass
    class OrchestratorConfig(Config):
        max_queue: int = option(256, "requests waiting beyond the target's slots",
                                env="FLASHMAP_MAX_QUEUE", check=at_least(0))

gives `--max-queue N` (flag: the field's name), read from $FLASHMAP_MAX_QUEUE when the flag is
not given, 256 when neither is. `parse(OrchestratorConfig, argv)` builds the parser, reads the
environment and returns the config; `to_argv(config)` writes one back as the flags that make it
(how `flashmap up` starts a service, from a config `from_env` made). Making a config runs every
field's check and the class's `check()` (rules between fields), whoever makes it: the command
line, `flashmap up`, a test. A bad value is a ValueError naming the flag; `parse` turns it into
a usage error.

Secrets are options with `secret=True`: no flag (a command line is visible to every user of the
machine), read by flashmap.auth.read_secret (the variable, or the file $VAR_FILE names).

Why dataclasses and not pydantic-settings or tyro: the variable names do not follow from the
flags (the drafter's --target-dir and the orchestrator's --tokenizer-dir both read
FLASHMAP_TARGET_DIR, the drafter's --port reads FLASHMAP_DRAFTER_PORT), so each field names its
own either way; checks, flags with units and the way back to a command line are a few lines
here; and the core stays stdlib + numpy (the drafter and Triton images carry no pydantic).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from flashmap.auth import read_secret

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Option:
    help: str
    env: str | None = None  # the environment variable that sets it when the flag is not given
    flag: str | None = ""  # "": --the-field-name; None: no flag (environment only)
    check: Callable[[Any], object] | None = None  # raises ValueError for a bad value
    choices: tuple | None = None
    scale: float = 1.0  # the field holds the flag's value times this (--burst-window-ms: seconds)
    secret: bool = False


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    env: str | None = None,
    flag: str | None = "",
    check: Callable[[Any], object] | None = None,
    choices: Sequence | None = None,
    scale: float = 1.0,
    secret: bool = False,
    default_factory: Callable[[], Any] | Any = MISSING,
) -> Any:
    """A config field that is also a flag and/or an environment variable (module docstring)."""
    meta = Option(
        help,
        env,
        None if secret else flag,
        check,
        tuple(choices) if choices else None,
        scale,
        secret,
    )
    return field(default=default, default_factory=default_factory, metadata={"option": meta})


def same_as(cls: type, name: str, **changes) -> Any:
    """Another config's option, default, help, variable and check included (changes: Option
    fields to differ in): a config that composes services (flashmap up's StackConfig) offers
    their options without copying them."""
    f = next(f for f in fields(cls) if f.name == name)
    meta = {"option": dataclasses.replace(f.metadata["option"], **changes), "same_as": (cls, name)}
    return field(default=f.default, default_factory=f.default_factory, metadata=meta)


def values_for(config: Any, cls: type) -> dict[str, Any]:
    """config's values of cls's options (its fields made by same_as(cls, ...)), under cls's
    names: what a composing config hands the part it composes."""
    return {
        f.metadata["same_as"][1]: getattr(config, f.name)
        for f in fields(config)
        if f.metadata.get("same_as", (None,))[0] is cls
    }


# ---------------------------------------------------------------------------- checks


def at_least(lo: float) -> Callable[[Any], None]:
    def check(v) -> None:
        if v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")

    return check


def in_range(lo: float, hi: float) -> Callable[[Any], None]:
    def check(v) -> None:
        if not lo <= v <= hi:
            raise ValueError(f"must be in {lo}..{hi}, got {v}")

    return check


class Config:
    """Base of the service configs (dataclasses): checked when made."""

    def __post_init__(self) -> None:
        for f, opt in _options(type(self)):
            value = getattr(self, f.name)
            if value is None:
                continue
            try:
                if opt.choices and value not in opt.choices:
                    raise ValueError(f"must be one of {', '.join(map(str, opt.choices))}")
                if opt.check is not None:
                    opt.check(value)
            except ValueError as e:
                raise ValueError(f"{_name(f, opt)}: {e}") from None
        self.check()

    def check(self) -> None:
        """Rules between fields (ValueError); the fields' own checks have passed."""


# ---------------------------------------------------------------------------- command line


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    env: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """A flag per option of cls, its default the environment's value or the field's (or the
    caller's `defaults`: a command that decides some itself, as `flashmap up` the checkpoints)."""
    env = os.environ if env is None else env
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    for f, opt in _options(cls):
        if opt.flag is None:
            continue
        kind = _kind(hints[f.name])
        positional = bool(opt.flag) and not opt.flag.startswith("-")
        kw: dict[str, Any] = {} if positional else {"dest": f.name}
        default = defaults[f.name] if f.name in defaults else _default(f)
        if opt.env and opt.env in env:
            try:
                default = _from_text(env[opt.env], hints[f.name], opt)
            except ValueError as e:
                parser.error(f"${opt.env}: {e}")
        elif default is MISSING and not positional:
            kw["required"] = True
        if default is not MISSING:
            kw["default"] = default
        if positional:
            kw["nargs"] = "?"
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:  # a repeatable flag
            kw["action"] = "append"
            kw["type"] = _flag_type(typing.get_args(kind)[0], opt)
        else:
            kw["type"] = _flag_type(hints[f.name], opt)
            flag = opt.flag or f.name
            kw["metavar"] = (
                "{" + ",".join(opt.choices) + "}"
                if opt.choices
                else flag.lstrip("-").upper().replace("-", "_")
            )
        where = [f"${opt.env}"] if opt.env else []  # and what this command gets without the flag
        if kind is bool:
            where.append(f"default {'on' if default else 'off'}")
        elif default not in (MISSING, None, []):
            where.append(f"default {_to_text(default, opt)}")
        kw["help"] = opt.help + (f" ({'; '.join(where)})" if where else "")
        parser.add_argument(opt.flag or "--" + f.name.replace("_", "-"), **kw)


def from_args(cls: type, ns: argparse.Namespace, env: Mapping[str, str] | None = None, **extra):
    """cls from parsed flags (add_arguments), environment-only options from the environment,
    and extra."""
    flags = {f.name: getattr(ns, f.name) for f, opt in _options(cls) if opt.flag is not None}
    return from_env(cls, env, **{**flags, **extra})


def from_env(cls: type, env: Mapping[str, str] | None = None, **values):
    """cls from values, and for the options not among them what the environment sets, then
    their defaults: the config the service would make of this environment by itself."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    for f, opt in _options(cls):
        if f.name in values or not opt.env:
            continue
        if opt.secret:
            values[f.name] = read_secret(opt.env) if env is os.environ else env.get(opt.env, "")
        elif opt.env in env:
            try:
                values[f.name] = _from_text(env[opt.env], hints[f.name], opt)
            except ValueError as e:
                raise ValueError(f"${opt.env}: {e}") from None
    return cls(**values)


def parse(
    cls: type,
    argv: Sequence[str] | None = None,
    description: str = "",
    prog: str | None = None,
):
    """The config a command line and the environment give (a usage error and exit 2 if bad)."""
    only_env = [f"${o.env}: {o.help}" for _, o in _options(cls) if o.flag is None]
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="From the environment only: " + "; ".join(only_env) if only_env else None,
    )
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return from_args(cls, ns)
    except ValueError as e:
        parser.error(str(e))


def to_argv(config: Any) -> list[str]:
    """The flags that give this config (not its secrets: they travel in the environment)."""
    out = []
    for f, opt in _options(type(config)):
        value = getattr(config, f.name)
        if opt.flag is None or value is None:
            continue
        flag = opt.flag or "--" + f.name.replace("_", "-")
        if not flag.startswith("-"):  # positional
            out.append(_to_text(value, opt))
        elif isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [f"{flag}={_to_text(v, opt)}" for v in value]
        else:
            out.append(f"{flag}={_to_text(value, opt)}")
    return out


# ---------------------------------------------------------------------------- helpers


def _options(cls: type) -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata["option"]) for f in fields(cls) if "option" in f.metadata]


def _name(f: dataclasses.Field, opt: Option) -> str:
    return (opt.flag or "--" + f.name.replace("_", "-")) if opt.flag is not None else f"${opt.env}"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _kind(t: Any) -> type:
    """The type of a field, without `| None`."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        (t,) = [a for a in typing.get_args(t) if a is not type(None)]
    return t


def _from_text(text: str, t: Any, opt: Option, unset_if_empty: bool = True) -> Any:
    """A flag's or a variable's text as the field's type. An empty variable of an optional
    field is unset (compose writes ${VAR:-} as ""); an empty flag is an empty value."""
    optional = _kind(t) is not t
    kind = _kind(t)
    if optional and text == "" and unset_if_empty:
        return None
    if _is_json(kind):
        return _from_json(text, kind)
    if typing.get_origin(kind) is list:  # from the environment: comma-separated
        (elem,) = typing.get_args(kind)
        if _is_json(elem):  # a list of JSON values: one JSON array
            return _from_json(text, list)
        return [_from_text(x, elem, opt) for x in text.split(",") if x.strip()]
    if kind is bool:
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise ValueError(f"expected one of {TRUE + FALSE[:-1]}, got {text!r}")
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"expected {kind.__name__}, got {text!r}") from None
    return value * opt.scale if opt.scale != 1.0 else value


def _is_json(kind: Any) -> bool:
    """A type that a flag or a variable spells as JSON text (a dict, Any)."""
    return kind is dict or typing.get_origin(kind) is dict or kind is Any


def _from_json(text: str, kind: Any) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"expected JSON, got {text!r}") from None
    want = typing.get_origin(kind) or kind
    if want is not Any and not isinstance(value, want):
        raise ValueError(f"expected a JSON {'object' if want is dict else 'array'}, got {text!r}")
    return value


def _flag_type(t: Any, opt: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return _from_text(text, t, opt, unset_if_empty=False)
        except ValueError as e:  # argparse prints an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _to_text(value: Any, opt: Option) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if opt.scale != 1.0:
        value = round(value / opt.scale, 9)
    return str(value)
