"""Model budgets for the platform team (docs/model-budgets.md): `GET` and `PUT
/model-budgets` (admin scope, validated, problem+json on bad input, no partial write) and
`turnstile model-budgets list|set`, both over the same rows, with the settings' defaults; the
figures in `GET /queue/stats` for admin keys."""

from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.processes import run_cli

ENDPOINT = "gpt-4o-mini@https://api.openai.com/v1"


async def test_an_admin_sets_and_reads_an_endpoints_budget(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, model_rpm=500) as api:
        admin = await api.client("platform", "sre", "admin")
        empty = await admin.get("/model-budgets")
        assert empty.status_code == 200, empty.text
        assert empty.json() == {
            "defaults": {"requests_per_minute": 500, "tokens_per_minute": None},
            "budgets": [],
        }
        put = await admin.put(
            "/model-budgets", json={"endpoint": ENDPOINT, "tokens_per_minute": 200_000}
        )
        assert put.status_code == 200, put.text
        document = put.json()
        assert document["overrides"] == {"requests_per_minute": None, "tokens_per_minute": 200_000}
        assert document["effective"] == {"requests_per_minute": 500, "tokens_per_minute": 200_000}
        assert (document["requests_used"], document["reservations"]) == (0, 0)
        listed = (await admin.get("/model-budgets")).json()["budgets"]
        assert [b["endpoint"] for b in listed] == [ENDPOINT]
        for bad in (
            {"endpoint": ENDPOINT, "tokens_per_minute": 0},
            {"endpoint": ENDPOINT, "requests_per_minute": "many"},
            {"endpoint": "", "tokens_per_minute": 5},
            {"endpoint": "a b", "tokens_per_minute": 5},
            {"endpoint": ENDPOINT, "burst": 5},
        ):
            refused = await admin.put("/model-budgets", json=bad)
            assert refused.status_code == 422, (bad, refused.text)
            assert refused.headers["content-type"] == "application/problem+json"
        unchanged = (await admin.get("/model-budgets")).json()["budgets"][0]
        assert unchanged["overrides"]["tokens_per_minute"] == 200_000
        stats = (await admin.get("/queue/stats")).json()
        assert [b["endpoint"] for b in stats["model_budgets"]] == [ENDPOINT]
        assert stats["model_budgets"][0]["effective"]["tokens_per_minute"] == 200_000
        operator = await api.client("acme", "ops", "operator")
        own = await operator.get("/queue/stats")
        assert own.status_code == 200
        assert own.json()["model_budgets"] == []  # a budget is every tenant's
        assert (await operator.get("/model-budgets")).status_code == 403
        assert (
            await operator.put("/model-budgets", json={"endpoint": ENDPOINT})
        ).status_code == 403


async def test_the_cli_sets_and_lists_budgets(database_url: str) -> None:
    env = {"DATABASE_URL": database_url, "TURNSTILE_MODEL_TPM": "90000"}
    code, out, err = await run_cli(
        "model-budgets", "set", ENDPOINT, "--rpm", "60", "--json", env=env
    )
    assert code == 0, err
    document = json.loads(out)
    assert document["effective"] == {"requests_per_minute": 60, "tokens_per_minute": 90000}
    code, out, err = await run_cli("model-budgets", "set", ENDPOINT, "--rpm", "0", env=env)
    assert code == 2
    assert "requests_per_minute" in err
    code, out, err = await run_cli("model-budgets", "set", ENDPOINT, env=env)
    assert code == 2
    assert "nothing to set" in err
    code, out, err = await run_cli("model-budgets", "set", ENDPOINT, "--rpm", "default", env=env)
    assert code == 0, err
    code, out, err = await run_cli("model-budgets", "list", "--json", env=env)
    assert code == 0, err
    listed = json.loads(out)
    assert listed["defaults"] == {"requests_per_minute": None, "tokens_per_minute": 90000}
    assert listed["budgets"][0]["overrides"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
    }


async def test_an_admin_sets_and_reads_a_tenants_limits_on_model_endpoints(
    database_url: str, engine: AsyncEngine
) -> None:
    """`PUT /tenants/{t}/model-budgets` (an endpoint, or null: every endpoint), validated with
    problem+json and no partial write; `GET` lists them; `GET /model-budgets` shows them per
    tenant beside what each tenant holds and used."""
    async with running_api(database_url, engine) as api:
        admin = await api.client("platform", "sre", "admin")
        every = await admin.put(
            "/tenants/acme/model-budgets", json={"endpoint": None, "tokens_per_minute": 90_000}
        )
        assert every.status_code == 200, every.text
        assert every.json()["endpoint"] is None
        assert every.json()["tokens_per_minute"] == 90_000
        own = await admin.put(
            "/tenants/acme/model-budgets",
            json={"endpoint": ENDPOINT, "requests_per_minute": 30},
        )
        assert own.status_code == 200, own.text
        assert (own.json()["requests_per_minute"], own.json()["tokens_per_minute"]) == (30, None)
        for bad in (
            {"endpoint": ENDPOINT, "tokens_per_minute": 0},
            {"endpoint": ENDPOINT, "requests_per_minute": "many"},
            {"endpoint": ENDPOINT, "requests_per_minute": True},
            {"endpoint": "a b", "tokens_per_minute": 5},
            {"endpoint": "", "tokens_per_minute": 5},
            {"tokens_per_minute": 5},  # the endpoint, or null for every one, is required
            {"endpoint": ENDPOINT, "burst": 5},
        ):
            refused = await admin.put("/tenants/acme/model-budgets", json=bad)
            assert refused.status_code == 422, (bad, refused.text)
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["type"].endswith("/invalid-request")
        bad_tenant = await admin.put(
            "/tenants/%00/model-budgets", json={"endpoint": None, "tokens_per_minute": 5}
        )
        assert bad_tenant.status_code == 422
        assert bad_tenant.headers["content-type"] == "application/problem+json"
        listed = await admin.get("/tenants/acme/model-budgets")
        assert listed.status_code == 200, listed.text
        assert [
            (b["endpoint"], b["requests_per_minute"], b["tokens_per_minute"])
            for b in listed.json()["budgets"]
        ] == [(None, None, 90_000), (ENDPOINT, 30, None)]
        (budget,) = (await admin.get("/model-budgets")).json()["budgets"]
        assert budget["endpoint"] == ENDPOINT
        assert budget["provider"] == {"requests_per_minute": None, "tokens_per_minute": None}
        assert (budget["booked"], budget["booked_tokens"]) == (0, 0)
        (acme,) = budget["tenants"]
        assert acme["tenant_id"] == "acme"
        assert acme["limits"] == {"requests_per_minute": 30, "tokens_per_minute": 90_000}
        assert (acme["requests_used"], acme["tokens_used"], acme["tenant_booked"]) == (0, 0, 0)
        stats = (await admin.get("/queue/stats")).json()
        assert stats["model_budgets"][0]["tenants"][0]["limits"]["requests_per_minute"] == 30
        operator = await api.client("acme", "ops", "operator")
        assert (await operator.get("/tenants/acme/model-budgets")).status_code == 403
        refused = await operator.put(
            "/tenants/acme/model-budgets", json={"endpoint": None, "tokens_per_minute": 1}
        )
        assert refused.status_code == 403
        document = (await admin.get("/openapi.json")).json()
        tenant_schema = document["components"]["schemas"]["ModelBudgetTenant"]
        assert {"requests_used", "tokens_used", "limits", "tenant_booked"} <= set(
            tenant_schema["properties"]
        )


async def test_the_cli_sets_and_shows_a_tenants_limits(database_url: str) -> None:
    env = {"DATABASE_URL": database_url}
    code, out, err = await run_cli(
        "model-budgets",
        "set-tenant",
        "acme",
        "--endpoint",
        ENDPOINT,
        "--tpm",
        "5000",
        "--json",
        env=env,
    )
    assert code == 0, err
    assert json.loads(out)["tokens_per_minute"] == 5000
    code, out, err = await run_cli(
        "model-budgets", "set-tenant", "acme", "--rpm", "20", "--json", env=env
    )
    assert code == 0, err
    assert json.loads(out)["endpoint"] is None  # every endpoint
    for args, message in (
        (("--endpoint", ENDPOINT, "--tpm", "0"), "tokens_per_minute"),
        (("--endpoint", ENDPOINT, "--tpm", "lots"), "--tpm takes a whole number"),
        (("--endpoint", "a b", "--tpm", "5"), "endpoint"),
        ((), "nothing to set"),
    ):
        code, out, err = await run_cli("model-budgets", "set-tenant", "acme", *args, env=env)
        assert code == 2, (args, out, err)
        assert message in err
        assert "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    code, out, err = await run_cli(
        "model-budgets",
        "set-tenant",
        "acme",
        "--endpoint",
        ENDPOINT,
        "--tpm",
        "default",
        env=env,
    )
    assert code == 0, err
    code, out, err = await run_cli("model-budgets", "tenant", "acme", "--json", env=env)
    assert code == 0, err
    assert [
        (b["endpoint"], b["requests_per_minute"], b["tokens_per_minute"])
        for b in json.loads(out)["budgets"]
    ] == [(None, 20, None), (ENDPOINT, None, None)]
