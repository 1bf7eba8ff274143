"""A Dockerfile read as data: stages of instructions, with ARG and ENV substituted.

Enough of the Dockerfile syntax for the project's own images (line continuations,
comments, exec-form JSON, ``${VAR}``), so tests can check their structure and replay
their install and start steps without a container runtime.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, …
    text: str  # the rest of the line, as written
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, else None."""
        text = self.text
        if self.keyword == "HEALTHCHECK":
            _, _, text = text.partition(" CMD ")
        text = text.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(item, str) for item in value)
        return value


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]


def parse(path: Path) -> Dockerfile:
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), rest.strip(), start))
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.text.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert instruction.keyword == "ARG", f"{path}:{instruction.line}: only ARG may precede FROM"
            key, _, value = instruction.text.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(global_args, stages)


def substitute(text: str, values: dict[str, str]) -> str:
    """``${VAR}`` and ``$VAR`` replaced from ``values``; unknown names are left as they are."""
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def assignments(text: str) -> dict[str, str]:
    """``KEY=value KEY2="v 2"`` (ENV or ARG) as a dict, quotes removed."""
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', text)
    return {key: value[1:-1] if value.startswith('"') else value for key, value in pairs}
