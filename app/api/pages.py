"""The API's form of a keyset page of runs (the pages themselves: app/queue/pages.py)."""

from __future__ import annotations

from app.api.models import RunPage, run_document
from app.queue.pages import RunsPage


def run_page_document(page: RunsPage) -> RunPage:
    return RunPage(
        runs=[run_document(run.to_document()) for run in page.runs], next_cursor=page.next_cursor
    )
