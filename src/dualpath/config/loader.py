"""Load a Config from TOML or a dict, apply ``--set a.b=value`` overrides, dump as JSON.

Every mistake (unknown key, unparsable value, value out of range) is a ``ValueError`` whose
message names the key; the CLI prints it as one line and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dualpath.config.presets import DEFAULT_PRESET, HARDWARE_PRESETS, MODEL_PRESETS, preset
from dualpath.config.root import Config

_SECTION_PRESETS: dict[str, Mapping[str, Any]] = {
    "hardware": HARDWARE_PRESETS,
    "model": MODEL_PRESETS,
}
_SECTIONS = ("hardware", "model", "cluster", "scheduler", "workload", "sim", "reuse")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_json(config: Config) -> str:
    """The resolved config, stable key order, for ``config.json`` of each run."""
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


def _coerce(key: str, default: Any, value: Any) -> Any:
    """Convert ``value`` (from TOML or a ``--set`` string) to the type of ``default``."""
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is invalid: must be a {kind.__name__}") from None
    raise ValueError(f"{key} cannot be set (type {kind.__name__})")


def _update_section(section: str, base: Any, values: Mapping[str, Any]) -> Any:
    values = dict(values)
    if "preset" in values:
        table = _SECTION_PRESETS.get(section)
        name = values.pop("preset")
        if table is None:
            raise ValueError(f"{section}.preset is unknown: only hardware and model have presets")
        if name not in table:
            raise ValueError(
                f"{section}.preset={name!r} is invalid: must be one of {', '.join(sorted(table))}"
            )
        base = table[name]
    fields = {f.name: f for f in dataclasses.fields(base)}
    changes: dict[str, Any] = {}
    for key in sorted(values):
        if key not in fields:
            raise ValueError(
                f"unknown config key {section}.{key!s} (known: {', '.join(sorted(fields))})"
            )
        changes[key] = _coerce(f"{section}.{key}", getattr(base, key), values[key])
    return dataclasses.replace(base, **changes)


def _model_swap(config: Config, model: Any) -> dict[str, Any]:
    """The cluster settings a model preset swap resets: EP for MoE models, data parallel
    (no EP, so no nodes per EP group) for dense ones (design §13.1). Everything else is kept
    (``model_swap_note`` says what)."""
    ep = model.num_routed_experts > 0
    cluster = dataclasses.replace(
        config.cluster,
        prefill_ep=ep,
        decode_ep=ep,
        prefill_ep_nodes=config.cluster.prefill_ep_nodes if ep else 0,
        decode_ep_nodes=config.cluster.decode_ep_nodes if ep else 0,
    )
    return {"cluster": cluster}


def model_swap_note(before: Config, after: Config) -> str:
    """One line on a model swap ("" if the model did not change): what was reset, what kept."""
    if before.model.name == after.model.name:
        return ""
    ep = after.cluster.prefill_ep
    hw = after.hardware
    return (
        f"model {before.model.name} -> {after.model.name}: cluster.prefill_ep/decode_ep "
        f"set to {str(ep).lower()} ({'MoE: expert parallel' if ep else 'dense: data parallel'}, "
        f"design §13.1); kept: the hardware (pe/de buffers {hw.pe_buffer_bytes / 1e9:g}/"
        f"{hw.de_buffer_bytes / 1e9:g} GB), {after.cluster.label}, scheduler, workload "
        "(set them with --set if they belong to the model)"
    )


def from_dict(data: Mapping[str, Any], base: Config | None = None) -> Config:
    """Build a Config: start from ``data['preset']`` (or ``base``), then apply each section.
    A model preset swap (``model = "NAME"`` or ``[model] preset = ...``) resets the cluster's
    EP settings to the model's kind (``_model_swap``) unless ``data`` sets the cluster too."""
    data = dict(data)
    if "preset" in data:
        config = preset(str(data.pop("preset")))
    else:
        config = base if base is not None else preset(DEFAULT_PRESET)
    changes: dict[str, Any] = {}
    swapped = False  # a model preset named: the cluster's EP settings follow the model
    if "name" in data:
        changes["name"] = str(data.pop("name"))
    for key in sorted(data):
        if key not in _SECTIONS:
            raise ValueError(f"unknown config section {key!r} (known: {', '.join(_SECTIONS)})")
        value = data[key]
        if isinstance(value, str) and key in _SECTION_PRESETS:
            value = {"preset": value}
        if key == "model" and isinstance(value, Mapping) and "preset" in value:
            swapped = True
        if not isinstance(value, Mapping):
            raise ValueError(f"config section {key!r} must be a table of key = value")
        changes[key] = _update_section(key, getattr(config, key), value)
    if swapped and "cluster" not in data:
        changes.update(_model_swap(config, changes["model"]))
    return dataclasses.replace(config, **changes)


def load_toml(path: str | Path, base: Config | None = None) -> Config:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"config file {str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    return from_dict(data, base)


def parse_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ValueError(f"--set {text!r} is invalid: must look like section.key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """Apply ``section.key=value`` (or ``model=NAME`` / ``hardware=NAME``) overrides in order."""
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in _SECTION_PRESETS:
            config = from_dict({parts[0]: {"preset": value}}, config)
        elif len(parts) == 2:
            config = from_dict({parts[0]: {parts[1]: value}}, config)
        else:
            raise ValueError(f"--set {text!r} is invalid: must look like section.key=value")
    return config
