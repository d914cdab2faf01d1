"""The OpenAI Conversations API at `/v1` (issue 35): `POST /v1/conversations`,
`GET`/`POST`/`DELETE /v1/conversations/{id}`, and its items (`GET .../items`,
`GET .../items/{item_id}`), driven by the official `openai` SDK unchanged.

A conversation is a session (app/protocols/openai_conversations.py has the mapping); a
response joins it with `conversation` (or `previous_response_id`) on create
(app/api/responses_routes.py). What our transcript cannot do is refused in OpenAI's error shape,
saying why, never half done: items added other than through a response (a run writes the
transcript, under its fence) and an item deleted on its own. A conversation's metadata is its
session's (`sessions.metadata`, migration 0020): given on create, set key by key on update
(the keys given are set, the others kept, as OpenAI's API does; 16 pairs at most, counted on
the merged set). Deleting a conversation deletes its session and runs, once none of them is
active.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

from fastapi import APIRouter, Path, Query, Request

from app.api.auth import CallerDep, visible_principal
from app.api.json_responses import FastJSONResponse
from app.api.problems import ApiProblem
from app.api.responses_routes import invalid
from app.api.services import state_of
from app.api.sessions import visible_session
from app.protocols.openai_conversations import (
    CreateConversation,
    conversation_document,
    conversation_items,
    session_id_of,
)
from app.protocols.openai_conversations import conversation_id as conversation_id_of
from app.protocols.openai_responses import MAX_METADATA_PAIRS, list_page
from app.queue.errors import SessionNotFoundError
from app.queue.reads import SessionView
from app.security.api_keys import Caller
from app.vocabulary.records import TranscriptEntry

router = APIRouter(prefix="/v1", tags=["openai"], include_in_schema=False)

ConversationId = Annotated[str, Path(max_length=100)]
ItemId = Annotated[str, Path(max_length=100)]
# The entries an item listing reads at most (pages of the transcript's own size): the listing
# is derived from the whole transcript, so its cost is bounded here.
MAX_ENTRIES = 5_000
TRANSCRIPT_PAGE = 200
READ_ONLY = (
    "a conversation's items are its runs' transcript, written by the runs themselves: add items "
    "by creating a response with conversation=<id>, remove them by deleting the conversation"
)


async def conversation(request: Request, conversation: str, caller: Caller) -> SessionView:
    session_id = session_id_of(conversation)
    try:
        if session_id is None:
            raise SessionNotFoundError(UUID(int=0))
        return await visible_session(request, session_id, caller)
    except SessionNotFoundError:
        raise ApiProblem("not-found", f"no conversation {conversation!r}") from None


async def transcript(request: Request, session_id: UUID) -> list[TranscriptEntry]:
    reads = state_of(request).reads
    entries: list[TranscriptEntry] = []
    cursor: str | None = None
    while len(entries) < MAX_ENTRIES:
        page = await reads.session_transcript_page(session_id, cursor=cursor, limit=TRANSCRIPT_PAGE)
        entries.extend(page.entries)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    return entries


@router.post("/conversations")
async def create_conversation(body: CreateConversation, request: Request, caller: CallerDep) -> Any:
    if body.items:
        raise invalid("items", READ_ONLY)
    session = await state_of(request).reads.create_session(
        tenant_id=caller.tenant_id, principal=caller.principal, metadata=body.metadata
    )
    return FastJSONResponse(document(session))


def document(session: SessionView) -> dict[str, Any]:
    return conversation_document(session.id, session.created_at, session.metadata)


@router.get("/conversations/{conversation_id}")
async def get_conversation(
    conversation_id: ConversationId, request: Request, caller: CallerDep
) -> Any:
    session = await conversation(request, conversation_id, caller)
    return FastJSONResponse(document(session))


@router.post("/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: ConversationId,
    body: CreateConversation,
    request: Request,
    caller: CallerDep,
) -> Any:
    """The keys of `metadata` are set, the others kept (OpenAI's update); `items` are not
    taken here (they come from the conversation's responses)."""
    session = await conversation(request, conversation_id, caller)
    if body.items:
        raise invalid("items", READ_ONLY)
    if body.metadata:
        pairs = await state_of(request).reads.update_session_metadata(
            session.id,
            tenant_id=session.tenant_id,
            principal=visible_principal(caller),
            metadata=body.metadata,
            max_pairs=MAX_METADATA_PAIRS,
        )
        if pairs is None:
            raise ApiProblem("not-found", f"no conversation {conversation_id!r}")
        if pairs > MAX_METADATA_PAIRS:
            raise invalid(
                "metadata",
                f"a conversation holds at most {MAX_METADATA_PAIRS} metadata pairs: with these "
                f"keys set it would hold {pairs} (nothing was changed)",
            )
        session = await conversation(request, conversation_id, caller)
    return FastJSONResponse(document(session))


@router.delete("/conversations/{conversation_id}")
async def delete_conversation(
    conversation_id: ConversationId, request: Request, caller: CallerDep
) -> Any:
    session = await conversation(request, conversation_id, caller)
    deleted = await state_of(request).reads.delete_idle_session(
        session.id, tenant_id=caller.tenant_id, principal=visible_principal(caller)
    )
    if deleted == "missing":
        raise ApiProblem("not-found", f"no conversation {conversation_id!r}")
    if deleted == "active":
        raise ApiProblem(
            "session-busy",
            "a response of this conversation is still going (queued, in progress or waiting "
            "for an answer): cancel it first",
        )
    if deleted == "dead_letter":
        raise ApiProblem(
            "session-busy",
            "a response of this conversation failed and is in the dead letter: an operator "
            "dismisses it (or resubmits it) first",
        )
    return FastJSONResponse(
        {"id": conversation_id_of(session.id), "object": "conversation.deleted", "deleted": True}
    )


@router.get("/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: ConversationId,
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=100)] = None,
) -> Any:
    session = await conversation(request, conversation_id, caller)
    items = conversation_items(await transcript(request, session.id))
    return FastJSONResponse(list_page(items, order=order, after=after, limit=limit))


@router.get("/conversations/{conversation_id}/items/{item_id}")
async def get_item(
    conversation_id: ConversationId, item_id: ItemId, request: Request, caller: CallerDep
) -> Any:
    session = await conversation(request, conversation_id, caller)
    for item in conversation_items(await transcript(request, session.id)):
        if item["id"] == item_id:
            return FastJSONResponse(item)
    raise ApiProblem("not-found", f"no item {item_id!r} in conversation {conversation_id!r}")


@router.post("/conversations/{conversation_id}/items")
async def add_items(conversation_id: ConversationId, request: Request, caller: CallerDep) -> Any:
    await conversation(request, conversation_id, caller)
    raise invalid("items", READ_ONLY)


@router.delete("/conversations/{conversation_id}/items/{item_id}")
async def delete_item(
    conversation_id: ConversationId, item_id: ItemId, request: Request, caller: CallerDep
) -> Any:
    await conversation(request, conversation_id, caller)
    raise invalid("item_id", READ_ONLY)
