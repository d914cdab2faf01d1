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
