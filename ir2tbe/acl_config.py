"""acl.json: the ACL dump configuration the IR-to-TBE mapping reads (torch-free).

    {"dump": {"dump_list": [], "dump_path": "./output_IR2TBE",
              "dump_mode": "all", "dump_op_switch": "on"}}

The user guide's own example has no commas and a `#` comment, and users copy it.
We accept such a file: `#` comments (outside strings) are dropped, missing commas
between members are inserted, and a warning shows the corrected JSON so the user
can fix the file. Anything still not JSON after that is refused with one line.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from dumpfile.errors import DumpError

ACL_DUMP_ENV = "ACL_DUMP_DATA"
DEFAULT_CONFIG_NAME = "acl.json"
DUMP_MODES = ("output", "input", "all")
SWITCH_VALUES = ("on", "off")


class AclConfigError(DumpError):
    """acl.json is missing, unreadable, not JSON, or has a bad value."""


class AclConfigWarning(UserWarning):
    """acl.json was not strict JSON but could be repaired."""


@dataclass(frozen=True)
class AclConfig:
    dump_path: str = "./"
    dump_mode: str = "output"          # the original's default
    dump_op_switch: str = "off"        # the original's default: single-op dump off
    dump_list: tuple[str, ...] = ()    # op-name patterns; empty = every op
    source: str = ""                   # file it was read from, for messages
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def enabled(self) -> bool:
        return self.dump_op_switch == "on"

    @property
    def dump_inputs(self) -> bool:
        return self.dump_mode in ("input", "all")

    @property
    def dump_outputs(self) -> bool:
        return self.dump_mode in ("output", "all")


def check_acl_dump_env(environ=None) -> None:
    """Refuse to run while the global ACL dump is on (the guide's prerequisite)."""
    env = os.environ if environ is None else environ
    value = str(env.get(ACL_DUMP_ENV, "")).strip()
    if value not in ("", "0"):
        raise AclConfigError(
            f"{ACL_DUMP_ENV}={value}: load_with_acl_dump cannot run while the global ACL dump is on; "
            f"set `export {ACL_DUMP_ENV}=0` and run again")


_VALUE_START = frozenset('"{[-0123456789tfn')
_LITERAL_ENDS = ("true", "false", "null")


def repair_json(text: str) -> tuple[str, bool]:
    """(text, repaired): the guide's comma-less, commented JSON made strict.

    One pass, linear in the text (a regex with two `\\s*` around a newline backtracked
    quadratically: 60 KB of blank lines took 25 s): `#` and `//` comments outside
    strings are dropped; where a value ends a line and the next line starts a value, a
    comma is put right after the first value. Whitespace is held back until the next
    token shows whether a comma goes before it."""
    out: list[str] = []
    pending: list[str] = []         # whitespace since the last token, emitted with the next one
    n, i, changed = len(text), 0, False
    value_ended = False             # the last token ended a value ("...", digit, ], }, a literal)
    while i < n:
        c = text[i]
        if c == '"':                # a whole string, escapes included
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            token = text[i:j + 1]
            i = j + 1
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            changed = True
            continue
        elif c.isspace():
            pending.append(c)
            i += 1
            continue
        else:
            token = c
            i += 1
        if value_ended and token[0] in _VALUE_START and any("\n" in w for w in pending):
            out.append(",")
            changed = True
        out.extend(pending)
        pending.clear()
        out.append(token)
        value_ended = (token[0] == '"' or token in "]}" or token.isdigit()
                       or (token.isalpha() and "".join(out[-5:]).endswith(_LITERAL_ENDS)))
    out.extend(pending)
    return "".join(out), changed


# acl.json is a few hundred bytes; a bigger file is not one (and is not read into memory)
MAX_CONFIG_BYTES = 1 << 20


def parse_acl_config(data: Any, source: str = "acl.json") -> AclConfig:
    if not isinstance(data, dict) or "dump" not in data:
        raise AclConfigError(f'{source}: no "dump" key; expected {{"dump": {{"dump_path": ..., '
                             f'"dump_mode": "all", "dump_op_switch": "on", "dump_list": []}}}}')
    dump = data["dump"]
    if not isinstance(dump, dict):
        raise AclConfigError(f'{source}: "dump" must be an object, got {type(dump).__name__}')
    mode = str(dump.get("dump_mode", "output")).strip().lower()
    if mode not in DUMP_MODES:
        raise AclConfigError(f"{source}: unknown dump_mode {dump.get('dump_mode')!r}; use one of {', '.join(DUMP_MODES)}")
    switch = str(dump.get("dump_op_switch", "off")).strip().lower()
    if switch not in SWITCH_VALUES:
        raise AclConfigError(f"{source}: dump_op_switch must be \"on\" or \"off\", got {dump.get('dump_op_switch')!r}")
    dump_path = dump.get("dump_path", "./")
    if not isinstance(dump_path, str) or not dump_path.strip():
        raise AclConfigError(f"{source}: dump_path must be a non-empty string, got {dump_path!r}")
    return AclConfig(dump_path=dump_path, dump_mode=mode, dump_op_switch=switch,
                     dump_list=_dump_list(dump.get("dump_list", []), source), source=source,
                     extra={k: v for k, v in dump.items()
                            if k not in ("dump_path", "dump_mode", "dump_op_switch", "dump_list")})


def _dump_list(value: Any, source: str) -> tuple[str, ...]:
    """Op-name patterns. CANN's form {"model_name": ..., "layer": [...]} is accepted too."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise AclConfigError(f"{source}: dump_list must be a list, got {type(value).__name__}")
    names: list[str] = []
    for item in value:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, dict):
            layers = item.get("layer", [])
            if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
                raise AclConfigError(f'{source}: dump_list entry {item!r}: "layer" must be a list of op names')
            names.extend(layers)
        else:
            raise AclConfigError(f"{source}: dump_list entry {item!r} is neither an op name nor an object")
    return tuple(names)


def _loads(text: str, path: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:          # "[[[[..." nested past the interpreter's stack
        raise AclConfigError(f"{path}: JSON nested too deeply; not an acl.json") from None


def load_acl_config(path: str | os.PathLike | None = None) -> AclConfig:
    """Read acl.json (default: ./acl.json). A repaired file warns with the corrected JSON."""
    from dumpfile.errors import DumpFormatError
    from dumpfile.read.safety import open_regular

    path = os.fspath(path) if path is not None else DEFAULT_CONFIG_NAME
    if not os.path.lexists(path):
        raise AclConfigError(f"{path}: no such file (write acl.json next to the training script, "
                             f"or name it with --acl-config PATH; from Python: acl_config=PATH)") from None
    try:
        f = open_regular(path)          # a FIFO or device is refused, not waited on
    except DumpFormatError as e:
        raise AclConfigError(str(e)) from None
    try:
        with f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise AclConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; not an acl.json")
        text = raw.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise AclConfigError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from e
    try:
        data = _loads(text, path)
    except json.JSONDecodeError as first:
        fixed, repaired = repair_json(text)
        try:
            data = _loads(fixed, path)
        except json.JSONDecodeError:
            raise AclConfigError(f"{path}: not valid JSON ({first.msg} at line {first.lineno} "
                                 f"column {first.colno})") from first
        if repaired:
            warnings.warn(f"{path} is not strict JSON (missing commas / # comments); read it as: "
                          f"{json.dumps(data, separators=(', ', ': '))}", AclConfigWarning, stacklevel=2)
    return parse_acl_config(data, path)
