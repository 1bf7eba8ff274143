"""DATABASE_URL as both drivers take it, a multi-host one (a primary and its standbys) included."""

from __future__ import annotations

import asyncpg
import pytest
from asyncpg import connect_utils
from sqlalchemy.dialects.postgresql.asyncpg import dialect
from sqlalchemy.engine import make_url

from app.store.database import asyncpg_dsn, sqlalchemy_url
from app.store.errors import is_unavailable

LIBPQ = "postgresql://postgres:pw@db1:5433,db2/phasegate?target_session_attrs=read-write"


def test_a_libpq_multi_host_url_becomes_sqlalchemys_form() -> None:
    url = make_url(sqlalchemy_url(LIBPQ))
    assert url.drivername == "postgresql+asyncpg" and url.database == "phasegate"
    assert url.query["host"] == ("db1:5433", "db2:5432")  # SQLAlchemy wants every port
    assert url.query["target_session_attrs"] == "read-write"
    _, options = dialect().create_connect_args(url)
    assert (options["host"], options["port"]) == (["db1", "db2"], [5433, 5432])
    assert options["target_session_attrs"] == "read-write" and options["password"] == "pw"


@pytest.mark.parametrize("url", [LIBPQ, sqlalchemy_url(LIBPQ)])
def test_asyncpg_gets_every_host_in_order(url: str) -> None:
    addresses, params = connect_utils._parse_connect_dsn_and_args(  # what asyncpg.connect() does with it
        dsn=asyncpg_dsn(url),
        **dict.fromkeys(["host", "port", "user", "password", "passfile", "database", "ssl", "service"]),
        **dict.fromkeys(["servicefile", "direct_tls", "server_settings", "target_session_attrs"]),
        **dict.fromkeys(["krbsrvname", "gsslib"]),
    )[:2]
    assert addresses == [("db1", 5433), ("db2", 5432)]
    assert params.target_session_attrs is connect_utils.SessionAttribute.read_write
    assert (params.user, params.password, params.database) == ("postgres", "pw", "phasegate")


@pytest.mark.parametrize(
    "url",
    ["postgresql://u@h:5/db", "postgresql+asyncpg://postgres@/postgres?host=/var/run/pg"],
)
def test_a_single_host_url_is_unchanged_but_for_the_driver(url: str) -> None:
    assert make_url(sqlalchemy_url(url)).set(drivername="postgresql") == make_url(url).set(drivername="postgresql")
    assert asyncpg_dsn(url) == make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def test_an_empty_host_in_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="empty host"):
        sqlalchemy_url("postgresql://u@db1,,db2/db")


def test_no_writable_host_is_an_outage() -> None:
    # every host answered but none is the primary: a failover under way, so wait and reconnect
    assert is_unavailable(asyncpg.TargetServerAttributeNotMatched("none of the hosts is read-write"))
