"""instructor's structured output against one OpenAI-compatible server, run in the
instructor environment (``.ci/vllm-env`` builds it: instructor pins ``jiter<0.15``, which the
``openai`` client of the project's own environment cannot be installed beside).

    python tests/compat/instructor_call.py BASE_URL MODEL

prints one JSON line: what instructor gave its caller, whole (``create``) and streamed
(``create_partial``: each partial object it yielded, the last whole). Called by
tests/compat/test_frameworks.py against ``vllm serve`` and through phasegate.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

import instructor
from openai import OpenAI
from pydantic import BaseModel


class Unit(BaseModel):
    u: Literal["c", "f"]


def main(base_url: str, model: str) -> dict[str, Any]:
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused"), mode=instructor.Mode.JSON_SCHEMA)
    asked: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "unit?"}],
        "temperature": 0,
        "max_tokens": 60,
        "max_retries": 0,  # a wrong answer shows as it came, not asked again
    }
    whole = client.chat.completions.create(response_model=Unit, **asked)
    partials = [p.model_dump() for p in client.chat.completions.create_partial(response_model=Unit, **asked)]
    return {"create": whole.model_dump(), "partials": partials}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
