"""Tenant and principal names (issue 40, item 8): `keys create` took 5,000-character tenants
(which no API could then give limits), control characters, and look-alikes (`acme` in
fullwidth letters, `acme` with a zero-width space) as new tenants. Names are now normalised
(NFKC, edges trimmed) and checked in one place, app/vocabulary/names.py, which the keys, the
tenants' limits (API and CLI) and every --tenant and --principal of the CLI go through.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import create_key
from app.vocabulary.names import MAX_NAME_LENGTH, InvalidNameError, principal_name, tenant_name
from tests.support.api import running_api
from tests.support.processes import run_cli

FULLWIDTH_ACME = "\uff41\uff43\uff4d\uff45"
REFUSED = [
    pytest.param("", id="empty"),
    pytest.param("   ", id="blank"),
    pytest.param("x" * 5_000, id="5000-characters"),
    pytest.param("x" * (MAX_NAME_LENGTH + 1), id="one-too-long"),
    pytest.param("acme\u200b", id="zero-width-space"),
    pytest.param("\ufeffacme", id="byte-order-mark"),
    pytest.param("ac\u200dme", id="zero-width-joiner"),
    pytest.param("acme\u202e", id="bidi-override"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\x07b", id="bell"),
    pytest.param("a\nb", id="newline"),
    pytest.param("a\tb", id="tab"),
    pytest.param("a\u2028b", id="line-separator"),
    pytest.param("a\ue000b", id="private-use"),
    pytest.param("a\ud800b", id="lone-surrogate"),
    pytest.param("a\u0378b", id="unassigned"),
]


@pytest.mark.parametrize("name", REFUSED)
def test_names_that_cannot_be_a_tenant_or_a_principal_are_refused(name: str) -> None:
    for check in (tenant_name, principal_name):
        with pytest.raises(InvalidNameError):
            check(name)


def test_names_are_normalised_to_one_spelling() -> None:
    assert tenant_name(FULLWIDTH_ACME) == "acme"
    assert tenant_name("  acme ") == "acme"
    assert tenant_name("acme\u00a0corp") == "acme corp"  # a no-break space is a space
    assert principal_name("\ufb01ona") == "fiona"  # the ligature is two letters
    assert principal_name("alice@example.com") == "alice@example.com"
    assert tenant_name("Zürich") == "Zürich"  # accents stay, in composed form
    assert tenant_name("Zu\u0308rich") == "Zürich"
    assert tenant_name("x" * MAX_NAME_LENGTH) == "x" * MAX_NAME_LENGTH


async def test_keys_are_made_for_the_normalised_names(engine: AsyncEngine) -> None:
    new = await create_key(engine, tenant_id=FULLWIDTH_ACME, principal=" alice ")
    assert (new.info.tenant_id, new.info.principal) == ("acme", "alice")
    with pytest.raises(ValueError, match="tenant"):
        await create_key(engine, tenant_id="acme\u200b", principal="alice")
    with pytest.raises(ValueError, match="principal"):
        await create_key(engine, tenant_id="acme", principal="a" * 5_000)
    async with engine.connect() as conn:
        tenants = (await conn.execute(text("SELECT DISTINCT tenant_id FROM api_keys"))).all()
    assert [row[0] for row in tenants] == ["acme"]


async def cli(database_url: str, *args: str) -> tuple[int, str, str]:
    return await run_cli(*args, env={"DATABASE_URL": database_url})


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--tenant", "t" * 5_000),
        ("--tenant", "acme\u200b"),
        ("--tenant", "a\x07b"),
        ("--principal", "bob\x01"),
        ("--principal", ""),
    ],
)
async def test_keys_create_refuses_a_bad_name_in_one_line_and_makes_nothing(
    database_url: str, engine: AsyncEngine, option: str, value: str
) -> None:
    names = {"--tenant": "acme", "--principal": "alice", option: value}
    code, out, err = await cli(
        database_url, "keys", "create", *(part for pair in names.items() for part in pair)
    )
    assert code == 2, (out, err)
    assert out == ""
    assert err.startswith("turnstile: "), err
    assert option.removeprefix("--") in err
    assert len(err.strip().splitlines()) == 1, err
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM api_keys"))).scalar() == 0


async def test_the_cli_normalises_every_tenant_and_principal_it_is_given(
    database_url: str, engine: AsyncEngine
) -> None:
    code, out, err = await cli(
        database_url,
        "keys",
        "create",
        "--tenant",
        FULLWIDTH_ACME,
        "--principal",
        "ops",
        "--operator",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["tenant"] == "acme"
    # Filters and the tenants' limits take the same spelling.
    code, out, err = await cli(database_url, "keys", "list", "--tenant", FULLWIDTH_ACME, "--json")
    assert code == 0, err
    assert [k["tenant"] for k in json.loads(out)] == ["acme"]
    code, out, err = await cli(
        database_url, "tenants", "set", FULLWIDTH_ACME, "--max-queued", "7", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["tenant"] == "acme"
    code, out, err = await cli(database_url, "tenants", "get", "acme", "--json")
    assert json.loads(out)["overrides"]["max_queued"] == 7
    code, out, err = await cli(database_url, "tenants", "get", "a\x07b")
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    code, out, err = await cli(database_url, "runs", "stuck", "--tenant", "acme\u200b")
    assert code == 2
    assert "tenant" in err


async def test_the_api_takes_tenant_names_as_the_cli_does(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        admin = await api.client("platform", "root", "admin")
        response = await admin.put(f"/tenants/{FULLWIDTH_ACME}/limits", json={"max_queued": 3})
        assert response.status_code == 200, response.text
        assert response.json()["tenant"] == "acme"
        got = await admin.get("/tenants/acme/limits")
        assert got.json()["overrides"]["max_queued"] == 3
        too_long = await admin.get(f"/tenants/{'t' * 5_000}/limits")
        assert too_long.status_code == 422
