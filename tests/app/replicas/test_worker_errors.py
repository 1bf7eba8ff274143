"""The worker errors (``app/replicas/worker_errors.py``): each maps onto a failure kind, and
a refusal speaks of the client's parameter in the client's words."""

from __future__ import annotations

import pytest

from app.replicas.worker_errors import (
    AttemptEnded,
    ConnectFailed,
    ConnectTimedOut,
    ControlUnanswered,
    LeaseLost,
    MalformedFrame,
    ReadStalled,
    Rejected,
    ReplicaExiting,
    RequestRefused,
    StreamBroken,
    WorkerError,
)
from statemachine.events import FailureKind


def test_the_error_tree_maps_every_error_onto_a_failure_kind():
    expected = {
        ConnectFailed: FailureKind.REPLICA_EXITED,
        StreamBroken: FailureKind.REPLICA_EXITED,
        ReplicaExiting: FailureKind.REPLICA_EXITED,
        ConnectTimedOut: FailureKind.LIVENESS_UNCERTAIN,
        ReadStalled: FailureKind.LIVENESS_UNCERTAIN,
        MalformedFrame: FailureKind.LIVENESS_UNCERTAIN,
        ControlUnanswered: FailureKind.LIVENESS_UNCERTAIN,
        Rejected: FailureKind.REJECTED,
        RequestRefused: FailureKind.REQUEST_REFUSED,
        AttemptEnded: FailureKind.REPLICA_EXITED,
        LeaseLost: FailureKind.REPLICA_EXITED,
    }
    for cls, kind in expected.items():
        assert issubclass(cls, WorkerError) and cls.kind is kind
    assert {kind for kind in FailureKind} - set(expected.values()) == {FailureKind.OVERLOADED}  # a timer's call
    assert LeaseLost("x", code="stale_lease_epoch", status=409).released is False
    assert LeaseLost("x", code="unknown_attempt", status=404).released is True


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("params.top_k", "top_k"),  # a sampling parameter: the client's, under its own name
        ("messages[0].content", "messages[0].content"),
        ("tools[0].function.parameters", "tools[0].function.parameters"),
        ("lease_ttl_ms", None),  # the gateway's own field: no parameter of the client's
        (None, None),
    ],
)
def test_a_refusal_names_the_clients_parameter_where_the_workers_field_is_one(
    field: str | None, param: str | None
) -> None:
    refused = RequestRefused(f"{field}: must be valid", status=400, code="invalid_field", field=field)
    assert refused.param == param and refused.field == field
    assert refused.message == f"{param or field}: must be valid"  # in the client's words
