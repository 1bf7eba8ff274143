"""Responses read back from the log (docs/design.md §15), with the real `openai` client over
real sim workers: retrieved, listed, streamed again and continued by
``previous_response_id``, on another instance and after a restart, within the tenant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from app.config import Timeouts
from statemachine import events as ev
from tests.app.api.test_responses import request_id_of
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess


def test_a_stored_response_is_retrieved_from_the_log_on_another_instance_as_it_was_sent(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    asked = {"model": MODEL, "input": "keep this one", "instructions": "be brief", "max_output_tokens": 8}
    with running_gateway(database_url, sim_pair) as first:
        created = first.openai().responses.create(**asked, metadata={"ticket": "T-1"})
        with first.openai().responses.stream(**asked) as stream:
            list(stream)
            streamed = stream.get_final_response()
    with running_gateway(database_url, sim_pair) as second:  # another instance, after the first stopped
        client = second.openai()
        again = client.responses.retrieve(created.id)
        assert again.model_dump() == created.model_dump()
        again = client.responses.retrieve(streamed.id)  # the stream helper's own types aside
        assert (again.output_text, again.status, again.usage) == (streamed.output_text, streamed.status, streamed.usage)
        assert [i.id for i in again.output] == [i.id for i in streamed.output]
        assert (again.instructions, again.max_output_tokens) == ("be brief", 8)
        assert again.metadata is None  # none sent: null, as vLLM's
        items = client.responses.input_items.list(created.id, order="asc")
        listed = [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items.data]  # type: ignore[union-attr]
        assert listed == [("message", "user", "input_text", "keep this one")]
        for limit in ("0", "101", "²", "x"):  # "²" is a digit to str.isdigit, and no int
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.input_items.list(created.id, extra_query={"limit": limit})
            assert refused.value.body["param"] == "limit"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve("resp_" + "0" * 24)
        assert missing.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):  # a chat completion is not a response
            chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            client.responses.retrieve("resp_" + chat.id.removeprefix("chatcmpl-"))


def test_a_failed_response_is_retrieved_failed_with_what_its_client_was_sent(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("fail and keep")
    for worker in fresh_pair:
        add_fault(worker, action="die", point="after_frame", at_token=2, match={"prompt_contains": prompt})
    with running_gateway(database_url, fresh_pair, timeouts=Timeouts()) as gateway:
        events = list(gateway.openai().responses.create(model=MODEL, input=prompt, max_output_tokens=20, stream=True))
        sent = events[-1].response  # type: ignore[union-attr]
        again = gateway.openai().responses.retrieve(sent.id)
    assert again.status == "failed" and again.error is not None
    assert again.error.model_dump() == sent.error.model_dump()  # type: ignore[union-attr]
    assert again.output_text == sent.output_text != "" and again.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation_from_the_log_after_a_restart(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair) as first:
        one = first.openai().responses.create(model=MODEL, input="my name is Ada", max_output_tokens=6)
    with running_gateway(database_url, sim_pair) as second:  # a restart: nothing of `one` in memory
        client = second.openai()
        two = client.responses.create(
            model=MODEL, input="what is my name", previous_response_id=one.id, max_output_tokens=6, temperature=0
        )
        # the same conversation sent whole as chat: the same answer
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "my name is Ada"},
                {"role": "assistant", "content": one.output_text},
                {"role": "user", "content": "what is my name"},
            ],
            max_tokens=6,
            temperature=0,
        )
        assert two.previous_response_id == one.id
        assert two.output_text == chat.choices[0].message.content
        assert two.usage is not None and chat.usage is not None
        assert two.usage.input_tokens == chat.usage.prompt_tokens
        three = client.responses.create(
            model=MODEL, input="and again", previous_response_id=two.id, max_output_tokens=4
        )
        assert three.usage is not None and three.usage.input_tokens > two.usage.input_tokens
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model=MODEL, input="hi", previous_response_id="resp_" + "f" * 24)
        assert missing.value.code == "response_not_found"


def test_another_tenants_response_cannot_be_read_or_continued(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    with running_gateway(database_url, sim_pair, api_keys=keys) as gateway:
        mine = gateway.openai(api_key="key-a").responses.create(model=MODEL, input="mine", max_output_tokens=4)
        other = gateway.openai(api_key="key-b")
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=MODEL, input="yours?", previous_response_id=mine.id)


def test_without_the_text_in_the_log_a_conversation_is_refused_saying_why(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair, content_policy="digest") as gateway:
        client = gateway.openai()
        one = client.responses.create(model=MODEL, input="forget me", max_output_tokens=4)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="again", previous_response_id=one.id)
        assert refused.value.code == "response_content_unavailable"
        assert client.responses.retrieve(one.id).status == one.status  # the skeleton is there


def summary(events: list[Any]) -> list[tuple[str, int, str]]:
    return [(e.type, e.sequence_number, getattr(e, "delta", "")) for e in events]


def test_a_responses_stream_is_read_again_from_the_log_with_the_same_numbers(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair) as first:
        asked = {"model": MODEL, "input": "read me twice", "max_output_tokens": 12}
        with first.openai().responses.stream(**asked) as stream:  # type: ignore[call-overload]
            original = list(stream)
            sent = stream.get_final_response()
    with running_gateway(database_url, sim_pair) as second:  # another instance
        client = second.openai()
        with client.responses.stream(response_id=sent.id) as again:  # the SDK's helper: from the start
            reread = list(again)
            assert again.get_final_response().output_text == sent.output_text
        assert summary(reread) == summary(original)
        later = list(client.responses.retrieve(sent.id, stream=True, starting_after=5))
        assert summary(later) == summary(original)[6:]  # the server leaves out 0..5
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.retrieve(sent.id, extra_query={"starting_after": "x", "stream": "true"})
        assert refused.value.body["param"] == "starting_after"  # type: ignore[index]


def test_a_live_response_is_followed_to_its_end_by_a_second_reader(gateway: RunningGateway) -> None:
    client = gateway.openai()
    stream = client.responses.create(model=MODEL, input="a long one to follow", max_output_tokens=300, stream=True)
    original = []
    follower: Any = None
    for event in stream:
        original.append(event)
        if follower is None and event.type == "response.output_text.delta" and len(original) > 8:
            response_id = original[0].response.id  # type: ignore[union-attr]
            follower = client.responses.retrieve(response_id, stream=True)  # opened while live
    followed = list(follower)
    assert original[-1].type == "response.completed"
    assert summary(followed) == summary(original)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_same_post_again_with_its_idempotency_key_gets_the_same_response_once(
    gateway: RunningGateway, stream: bool
) -> None:
    client = gateway.openai()
    key = {"Idempotency-Key": f"resp-{stream}-{id(client)}"}
    asked = {"model": MODEL, "input": "only once", "max_output_tokens": 8, "extra_headers": key}
    if stream:
        first = list(client.responses.create(**asked, stream=True))
        again = list(client.responses.create(**asked, stream=True))
        assert summary(again) == summary(first) and first[-1].type == "response.completed"
        request_id = request_id_of(first[-1].response)  # type: ignore[union-attr]
    else:
        one = client.responses.create(**asked)
        two = client.responses.create(**asked)
        assert two.model_dump() == one.model_dump()
        request_id = request_id_of(one)
    with gateway.http() as http:
        other = http.post("/v1/responses", json={"model": MODEL, "input": "another body"}, headers=key)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    events = gateway.events(request_id)
    assert len(of(events, ev.RequestAccepted)) == 1 and len(of(events, ev.AttemptStarted)) == 1


def test_a_deleted_response_is_gone_and_its_events_stay_without_content(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    with running_gateway(database_url, sim_pair, api_keys=keys) as gateway:
        client = gateway.openai(api_key="key-a")
        response = client.responses.create(model=MODEL, input="delete me", max_output_tokens=6)
        with pytest.raises(openai.NotFoundError):  # not another tenant's to delete
            gateway.openai(api_key="key-b").responses.delete(response.id)
        client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.retrieve(response.id)
        assert gone.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(response.id)
        with pytest.raises(openai.BadRequestError) as refused:  # no text left to continue from
            client.responses.create(model=MODEL, input="go on", previous_response_id=response.id)
        assert refused.value.code == "response_content_unavailable"
        events = gateway.events(request_id_of(response))
    delivered = of(events, ev.DeltasDelivered)
    assert delivered and all(e.text is None for e in delivered)  # type: ignore[attr-defined]
    assert sum(e.tokens for e in delivered) == response.usage.output_tokens  # type: ignore[attr-defined,union-attr]
    assert isinstance(events[-1], ev.RequestCompleted)  # the skeleton, whole


def test_an_unstored_response_is_answered_and_the_log_keeps_only_digests_of_it(gateway: RunningGateway) -> None:
    client = gateway.openai()
    asked: dict[str, Any] = {"model": MODEL, "input": "keep nothing of this", "max_output_tokens": 8, "store": False}
    whole = client.responses.create(**asked)
    with client.responses.stream(**asked) as stream:
        list(stream)
        streamed = stream.get_final_response()
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    called = client.responses.create(**asked | {"tools": [lookup], "tool_choice": "required"})
    assert whole.store is False and whole.output_text and streamed.output_text == whole.output_text
    assert [item.type for item in called.output] == ["function_call"]
    for response in (whole, streamed, called):
        request_id = request_id_of(response)
        events = gateway.events(request_id)
        accepted = events[0]
        assert isinstance(accepted, ev.RequestAccepted) and accepted.content_policy == "digest"
        deltas = [e for e in events if isinstance(e, ev.DeltasDelivered | ev.DeltasProduced)]
        assert deltas and all(e.text is None and e.text_sha256 for e in deltas)
        assert all(e.arguments == "" and e.arguments_sha256 for e in of(events, ev.ToolCallEmitted))  # type: ignore[attr-defined]
        recorded = gateway.call(gateway.gateway.ctx.store.read_input(request_id))
        assert recorded is not None and set(recorded.body) == {"sha256"}  # its digest, never the input
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response.id)
        assert missing.value.code == "response_not_found" and "not stored" in missing.value.message
    assert len(of(gateway.events(request_id_of(called)), ev.ToolCallEmitted)) == 1
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="go on", previous_response_id=whole.id)
    stored = client.responses.create(model=MODEL, input="keep this", max_output_tokens=4)  # the gateway's own policy
    kept = gateway.events(request_id_of(stored))
    assert kept[0].content_policy is None and all(  # type: ignore[attr-defined]
        e.text for e in kept if isinstance(e, ev.DeltasDelivered)
    )
