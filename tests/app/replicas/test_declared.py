"""The declared sources' seam (app/replicas/declared.py): each source's set replaces what it
declared before, marked changed until the fleet's lock holder reconciled it; a DNS name's
replicas are named after the name, each model at the revision the entry gives it."""

from __future__ import annotations

from app.config import ReplicaConfig
from app.discover_config import parse_discover
from app.replicas.declared import DeclaredReplicas, dns_replicas
from app.store.fleet_model import in_scope


def test_a_dns_names_replicas_carry_the_name_and_each_models_revision() -> None:
    (entry,) = parse_discover([{"name": "vllm.test", "port": 9, "kind": "openai", "models": ["tiny=r1", "big"]}])
    found = dns_replicas(entry, {("127.0.0.5", 9), ("::1", 9)})
    assert [r.id for r in found] == ["127.0.0.5:9@vllm.test", "[::1]:9@vllm.test"]
    discovered = found[1]
    assert (discovered.url, discovered.kind, discovered.models) == ("http://[::1]:9", "openai", ("tiny", "big"))
    assert discovered.revisions == (("tiny", "r1"),)
    assert discovered.revision_of("tiny") == "r1" and discovered.revision_of("big") is None
    assert all(in_scope(r.id, "vllm.test") for r in found)
    assert not in_scope(found[0].id, "other.test") and not in_scope("w1", "vllm.test") and in_scope("w1", "")


def test_each_source_replaces_its_own_set_and_stays_changed_until_reconciled() -> None:
    w1, w2 = ReplicaConfig("w1", "http://127.0.0.1:9"), ReplicaConfig("w2", "http://127.0.0.1:10")
    declared = DeclaredReplicas([w1])
    assert declared.changed() == [("file", "")]  # the file at start
    declared.reconciled(("file", ""), (w1,))
    assert declared.changed() == []
    (entry,) = parse_discover([{"name": "vllm.test", "port": 9}])
    dns = dns_replicas(entry, {("127.0.0.5", 9)})
    declared.on_declared_replicas("dns", dns, scope="vllm.test", drain_s=30)
    declared.on_declared_replicas("file", [w2])
    assert declared.changed() == [("file", ""), ("dns", "vllm.test")]  # the file first
    assert declared.drain_s == {("dns", "vllm.test"): 30}
    declared.on_declared_replicas("dns", (), scope="vllm.test")
    declared.reconciled(("dns", "vllm.test"), dns)  # an older set reconciled: the newer one stays due
    assert ("dns", "vllm.test") in declared.changed()
    declared.all_changed()
    assert declared.changed() == [("file", ""), ("dns", "vllm.test")]


def test_a_forgotten_name_declares_nothing_once_and_is_then_gone() -> None:
    declared = DeclaredReplicas()
    (entry,) = parse_discover([{"name": "vllm.test", "port": 9}])
    declared.on_declared_replicas("dns", dns_replicas(entry, {("127.0.0.5", 9)}), scope="vllm.test", drain_s=5)
    declared.forget("dns", "vllm.test")
    assert declared.declared[("dns", "vllm.test")] == ()  # its replicas leave at the next reconciliation
    declared.reconciled(("dns", "vllm.test"), ())
    assert ("dns", "vllm.test") not in declared.declared and declared.drain_s == {}
    declared.forget("dns", "never.test")  # a name never resolved: nothing to do
    assert ("dns", "never.test") not in declared.declared


def test_readings_of_a_source_are_dropped_without_declaring_anything() -> None:
    w1 = ReplicaConfig("w1", "http://127.0.0.1:9")
    declared = DeclaredReplicas([w1])
    (entry,) = parse_discover([{"name": "vllm.test", "port": 9}])
    declared.on_declared_replicas("dns", dns_replicas(entry, {("127.0.0.5", 9)}), scope="vllm.test", drain_s=5)
    declared.drop("dns")  # this process lost the fleet's lock: it resolves no more
    assert list(declared.declared) == [("file", "")] and declared.drain_s == {}
    assert declared.changed() == [("file", "")]
