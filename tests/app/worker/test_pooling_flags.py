"""``phasegate worker``'s flags for a pooling model: ``vllm serve``'s ``--runner`` and
``--convert``, passed to vLLM's engine arguments as ``vllm serve`` passes them
(docs/design.md §17, app/worker/vllm_pooling.py)."""

from __future__ import annotations

import pytest

from app.worker.config import config_from_args
from tests.app.worker.test_join_flags import parse

VLLM = ["--engine", "vllm", "--model-path", "/models/m"]


def test_runner_and_convert_are_vllm_engine_arguments() -> None:
    config = config_from_args(parse([*VLLM, "--convert", "embed", "--vllm-args", '{"enforce_eager": true}']))
    assert config.vllm_args == {"enforce_eager": True, "convert": "embed"}
    config = config_from_args(parse([*VLLM, "--runner", "pooling", "--vllm-args", '{"convert": "classify"}']))
    assert config.vllm_args == {"runner": "pooling", "convert": "classify"}
    assert config_from_args(parse(VLLM)).vllm_args == {}  # vLLM's own defaults ("auto")


@pytest.mark.parametrize("argv", [["--convert", "embed"], ["--runner", "pooling"]])
def test_the_sim_engine_refuses_them(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="--runner and --convert are vLLM's"):
        config_from_args(parse(argv))


def test_only_vllms_choices_are_taken() -> None:
    with pytest.raises(SystemExit):
        parse([*VLLM, "--convert", "reward"])  # argparse: not one of vllm serve's choices
