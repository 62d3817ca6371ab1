"""The runs' custom search attributes: what `temporal workflow list --query` and `laminar list` search.

TrainingRunWorkflow keeps them up to date (workflows/status.py `upsert_search_attributes`) when the
run was started with them, which the starter does only where the namespace has them registered
(`laminar dev up` registers them; elsewhere `register` or `temporal operator search-attribute create`).
A server without them therefore still runs every run; its runs are just not searchable by these names.

    temporal workflow list --query "LaminarPhase='running'"
    temporal workflow list --query "LaminarMode='laminar' AND LaminarStep >= 100"
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError

MODE = SearchAttributeKey.for_keyword("LaminarMode")  # run.mode: laminar, sync, one_step, stream, partial_rollout
PHASE = SearchAttributeKey.for_keyword("LaminarPhase")  # starting, running, paused, stopping, finished
STEP = SearchAttributeKey.for_int("LaminarStep")  # trainer steps committed
POLICY_VERSION = SearchAttributeKey.for_int("LaminarPolicyVersion")  # the trainer's policy version
REWARD = SearchAttributeKey.for_float("LaminarReward")  # mean reward of the last committed step

SEARCH_ATTRIBUTES = (MODE, PHASE, STEP, POLICY_VERSION, REWARD)
_INDEXED = {"KEYWORD": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, "INT": IndexedValueType.INDEXED_VALUE_TYPE_INT,
            "DOUBLE": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE}


async def missing(client: Client, namespace: str) -> list[str]:
    """Names of our search attributes the namespace does not have registered."""
    got = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    return [k.name for k in SEARCH_ATTRIBUTES if k.name not in got.custom_attributes]


async def register(client: Client, namespace: str) -> list[str]:
    """Register the missing ones (idempotent); returns the names added."""
    todo = await missing(client, namespace)
    if todo:
        by_name = {k.name: k for k in SEARCH_ATTRIBUTES}
        await client.operator_service.add_search_attributes(AddSearchAttributesRequest(
            namespace=namespace,
            search_attributes={n: _INDEXED[by_name[n].indexed_value_type.name] for n in todo}))
    return todo


async def initial(client: Client, namespace: str, mode: str) -> TypedSearchAttributes | None:
    """The attributes a new run starts with, or None when the namespace lacks any of them (the workflow then
    upserts nothing: an unregistered attribute would fail its workflow tasks), or when the server will not say
    (the operator service may be closed to this client, as on hosted namespaces)."""
    try:
        if await missing(client, namespace):
            return None
    except RPCError:
        return None
    return TypedSearchAttributes([SearchAttributePair(MODE, mode), SearchAttributePair(PHASE, "starting"),
                                  SearchAttributePair(STEP, 0), SearchAttributePair(POLICY_VERSION, 0)])
