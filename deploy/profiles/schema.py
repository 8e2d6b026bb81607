"""Engine profiles: the router's cost-model profile plus what a profile-timed emulator of a vLLM
engine needs, one file per (model, GPU, TP), read and written here.

A file is the router's `[[profile]]` table (model, kv_bytes_per_token, min_reuse_tokens,
[profile.prefill], [profile.link]: kvshuttle.router.cost reads those and ignores the rest) with
three more sections:

    [profile.decode]    itl_ms = fixed_ms + per_seq_ms * batch + per_ctx_token_ns * 1e-6 * ctx
                        (ctx: context tokens of every sequence in the batch), max_batch
    [profile.engine]    kv_capacity_tokens, block_size, max_num_batched_tokens,
                        gpu_memory_utilization
    [profile.hardware]  gpu, tp, gpus_per_engine, gpu_memory_gib

Loading is strict where the router's is lenient: a missing section, an unknown key or a number
out of range is refused with the field's name.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from kvshuttle.router.cost import LinkModel, PrefillModel

SECTIONS = ("prefill", "link", "decode", "engine", "hardware")
_TOP_LEVEL = ("model", "kv_bytes_per_token", "min_reuse_tokens", *SECTIONS)

_Section = TypeVar("_Section")
_Number = TypeVar("_Number", int, float)


class ProfileError(ValueError):
    """A profile file that does not hold a complete, valid engine profile."""


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Time of one decode step (inter-token latency) of a batch."""

    fixed_ms: float
    per_seq_ms: float
    per_ctx_token_ns: float
    # Most sequences decoded together (vLLM's max_num_seqs).
    max_batch: int

    def itl_ms(self, batch: int, ctx_tokens: int) -> float:
        """One step of `batch` sequences holding `ctx_tokens` tokens of context in all."""
        return self.fixed_ms + self.per_seq_ms * batch + self.per_ctx_token_ns * 1e-6 * ctx_tokens


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What one engine (TP group) holds and schedules."""

    kv_capacity_tokens: int
    block_size: int
    # Chunked prefill: the most tokens one step computes (vLLM's max_num_batched_tokens).
    max_num_batched_tokens: int
    gpu_memory_utilization: float

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class Hardware:
    # aiconfigurator's system name (h200_sxm, h100_sxm) or "cpu".
    gpu: str
    tp: int
    # Goodput per GPU divides by this (TP x PP).
    gpus_per_engine: int
    gpu_memory_gib: float


@dataclass(frozen=True, slots=True)
class EngineProfile:
    model: str
    kv_bytes_per_token: int
    min_reuse_tokens: int
    prefill: PrefillModel
    link: LinkModel
    decode: DecodeModel
    engine: EngineLimits
    hardware: Hardware


def load_engine_profiles(path: Path) -> list[EngineProfile]:
    """Every `[[profile]]` of a TOML file; ProfileError names the file and the bad field."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    try:
        return [engine_profile_from_dict(p) for p in data.get("profile", [])]
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def engine_profile_from_dict(data: Mapping[str, Any]) -> EngineProfile:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ProfileError("profile: model must be a non-empty string")
    where = f"profile {model}"
    _no_unknown(where, data, _TOP_LEVEL)
    for name in SECTIONS:
        if not isinstance(data.get(name), Mapping):
            raise ProfileError(f"{where}: missing section [profile.{name}]")
    profile = EngineProfile(
        model=model,
        kv_bytes_per_token=_number(
            where, "kv_bytes_per_token", data.get("kv_bytes_per_token"), int, positive=True
        ),
        min_reuse_tokens=_number(
            where, "min_reuse_tokens", data.get("min_reuse_tokens", 64), int, positive=False
        ),
        prefill=_section(where, "prefill", data["prefill"], PrefillModel, positive=()),
        link=_section(where, "link", data["link"], LinkModel, positive=("bandwidth_gb_s",)),
        decode=_section(where, "decode", data["decode"], DecodeModel, positive=("max_batch",)),
        engine=_section(
            where,
            "engine",
            data["engine"],
            EngineLimits,
            positive=("kv_capacity_tokens", "block_size", "max_num_batched_tokens", "gpu_memory_utilization"),
        ),
        hardware=_section(
            where,
            "hardware",
            data["hardware"],
            Hardware,
            positive=("tp", "gpus_per_engine", "gpu_memory_gib"),
        ),
    )
    if profile.engine.gpu_memory_utilization > 1:
        raise ProfileError(f"{where}: engine.gpu_memory_utilization must be at most 1")
    if profile.hardware.gpus_per_engine < profile.hardware.tp:
        raise ProfileError(f"{where}: hardware.gpus_per_engine must be at least hardware.tp")
    return profile


def _section(
    where: str, name: str, table: Mapping[str, Any], cls: type[_Section], *, positive: tuple[str, ...]
) -> _Section:
    """`cls` from a TOML table: every field present, no other key, numbers >= 0 (> 0 if in
    `positive`), ints where the field is an int."""
    specs = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    _no_unknown(f"{where}: [profile.{name}]", table, tuple(specs))
    values: dict[str, Any] = {}
    for key, spec in specs.items():
        label = f"{name}.{key}"
        if key not in table:
            raise ProfileError(f"{where}: missing {label}")
        if spec.type == "str":
            if not isinstance(table[key], str) or not table[key]:
                raise ProfileError(f"{where}: {label} must be a non-empty string")
            values[key] = table[key]
        else:
            kind = int if spec.type == "int" else float
            values[key] = _number(where, label, table[key], kind, positive=key in positive)
    return cls(**values)


def _number(where: str, label: str, value: Any, kind: type[_Number], *, positive: bool) -> _Number:
    ok_type = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise ProfileError(
            f"{where}: {label} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    number = kind(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ProfileError(
            f"{where}: {label} must be {'positive' if positive else 'at least 0'}, got {value!r}"
        )
    return number


def _no_unknown(where: str, table: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}")


def profile_toml(profile: EngineProfile, header: str) -> str:
    """The profile as a TOML file the router and load_engine_profiles read, `header` as its
    opening comment."""
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    lines += [
        "[[profile]]",
        f'model = "{profile.model}"',
        f"kv_bytes_per_token = {profile.kv_bytes_per_token}",
        f"min_reuse_tokens = {profile.min_reuse_tokens}",
    ]
    for name in SECTIONS:
        section = getattr(profile, name)
        lines += ["", f"[profile.{name}]"]
        lines += [f"{f.name} = {_toml_value(getattr(section, f.name))}" for f in fields(section)]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        # Five significant digits, always with a decimal point so TOML reads a float back.
        text = f"{value:.5g}"
        return text if any(c in text for c in ".en") else f"{text}.0"
    return str(value)
