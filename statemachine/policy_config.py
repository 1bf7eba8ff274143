"""The policy's knobs (docs/design.md §5), apart from the policy: what :mod:`statemachine.policy`
and the placement it calls (:mod:`statemachine.placing`) both read, so that neither
imports the other for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The knobs of the policy; replay can run with another one to compare."""

    max_attempts: int = 2
    # Cost guard: a retry whose prompt is longer than this fails fast (None: no guard).
    retry_max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.retry_max_prompt_tokens is not None and self.retry_max_prompt_tokens < 0:
            raise ValueError("retry_max_prompt_tokens must not be negative")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PolicyConfig:
        """Build from a parsed configuration file, rejecting unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown policy settings: {', '.join(unknown)}")
        for name, value in values.items():
            if value is not None and type(value) is not int:
                raise ValueError(f"policy setting {name} must be an integer")
        return cls(**values)
