"""What the coordinator's API accepts, and how it refuses the rest: always `{"error", "where", "fix"}`.

- Every query and path parameter states its bounds where it is declared: FastAPI checks them and
  the OpenAPI schema says them. (`limit=-1` once listed every job, and a `limit` past 2**63 reached
  SQLite as an OverflowError: a 500.)
- FastAPI's own refusals (a query value out of range, a body that is not JSON or not the model)
  come as our 400, not FastAPI's 422 shape: a client reads one error shape.
- A JSON body's nesting is counted before it is parsed (`BoundedJsonRoute`, `http_limits`).
- The schema documents these answers (and drops the 422 FastAPI would list), so a fuzzer
  (schemathesis, `tests/cluster/test_coordinator_fuzz.py`) holds the service to them.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from smolforge.errors import SmolforgeError
from smolforge.http_limits import MAX_JSON_DEPTH, json_depth
from smolforge.input_rules import check_input

SQL_INT_MAX = 2**63 - 1  # SQLite's INTEGER: ids past it do not exist, and binding one overflows
NAME = r"^[A-Za-z0-9_.:@-]+$"  # task, series and node names: what the runners write
INPUT_FIX = "send UTF-8 text without NUL bytes, within the lengths and ranges this API's schema states"

Since = Annotated[int, Query(ge=0, le=SQL_INT_MAX, description="only rows after this id")]
JobId = Annotated[str, Path(min_length=1, max_length=200, description="job id, a unique prefix, or its name")]
NodeId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="the node agent's id")]
TaskName = Annotated[str | None, Query(max_length=64, pattern=NAME, description="one task's lines (r0, teacher0)")]
SeriesName = Annotated[str | None, Query(max_length=200, pattern=NAME, description="one metric series")]
NodeName = Annotated[str | None, Query(max_length=128, pattern=NAME, description="one node's lines (w2, coordinator)")]
JobFilter = Annotated[str | None, Query(min_length=1, max_length=200, description="one job: id, unique prefix or name")]
LevelWord = Annotated[str | None, Query(max_length=16, description="that level and above: DEBUG, INFO, WARNING, ERROR, "
                                                                  "CRITICAL")]
GrepText = Annotated[str | None, Query(min_length=1, max_length=1000, description="lines containing this text "
                                                                                  "(case-sensitive); a pattern with regex")]
SinceTime = Annotated[str | None, Query(max_length=64, description="lines from this time on: 30s, 10m, 2h, 1d or an "
                                                                   "ISO time (UTC unless it carries an offset)")]
After = Annotated[int | None, Query(ge=0, le=SQL_INT_MAX, description="only lines after this id, oldest first "
                                                                      "(default: the newest lines)")]
StateList = Annotated[str | None, Query(max_length=200, description="comma-separated states, e.g. running,paused")]


def rows(default: int, most: int = 5000) -> Any:
    """A `limit` query parameter: 1..most rows, `default` when absent."""
    return Query(default, ge=1, le=most, description=f"at most this many rows (1..{most})")


class ApiError(BaseModel):
    """Every refusal: what went wrong, where, and how to fix it."""

    error: str
    where: str | None = None
    fix: str | None = None
    # the key path of a submitted spec's refused setting, where the check knows it: the client finds its
    # line in the file it read the spec from (`config.placed`); absent otherwise
    field: list[str | int] | None = None


class JoinRequest(BaseModel):
    node: str | None = Field(None, max_length=63, pattern=r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?$",
                             description="a worker node's name (default: lend the coordinator node)")


class LeaveRequest(BaseModel):
    node: str | None = Field(None, max_length=63, pattern=r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?$",
                             description="a worker node lent with `join` (default: the coordinator node)")


ERRORS = {status: {"model": ApiError, "description": text} for status, text in (
    (400, "bad request: a parameter out of range, a body that is not JSON or nests too deep, a spec that does "
          "not validate"),
    (401, "missing or wrong token"), (404, "no such job, artifact or file"),
    (413, "body over the route's size limit"))}


class BoundedJsonRoute(APIRoute):
    """A route whose input is checked before FastAPI parses it into the route's arguments: a JSON body
    that nests deeper than MAX_JSON_DEPTH (counted on the raw bytes; Starlette keeps the body for the
    parse that follows) and any path parameter, query value or JSON string or number that breaks the
    input rules (`smolforge.input_rules`: UTF-8 without NUL, a bounded length, finite 64-bit numbers)
    are a 400 naming where, before the route runs. (A lone surrogate in a spec was once stored, and
    every listing that showed the job answered 500 from then on.)"""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def checked(request: Request):
            check_input(request.path_params, "path", INPUT_FIX)
            for key, value in request.query_params.multi_items():
                check_input({key: value}, "query", INPUT_FIX)
            if not has_body:
                return await handler(request)
            # counted in a worker thread: a large body's count (linear, in Python) would stall the event
            # loop and every other request with it (the hostile load test's p99)
            if await run_in_threadpool(json_depth, await request.body()) > MAX_JSON_DEPTH:
                raise SmolforgeError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", where="body",
                                     fix="send the flat JSON this route documents")
            try:
                body = await request.json() if await request.body() else None  # Starlette keeps it for FastAPI
            except ValueError:
                body = None  # not JSON: FastAPI's own parse refuses it (400, "the body is not valid JSON")
            await run_in_threadpool(check_input, body, "body", INPUT_FIX)
            return await handler(request)

        return checked


def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as our 400: the first problem, where it is, and the count of the others."""
    problems = err.errors()
    first = problems[0] if problems else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or None
    if first.get("type") == "json_invalid":
        what = f"the body is not valid JSON ({(first.get('ctx') or {}).get('error', 'decode error')})"
        fix = "send a JSON document (Content-Type: application/json)"
    else:
        what = str(first.get("msg", "invalid request"))
        fix = "send values in the ranges this API's schema states"
    if len(problems) > 1:
        what += f" (and {len(problems) - 1} more)"
    return JSONResponse({"error": what, "where": where, "fix": fix}, status_code=400)


def document_errors(app: FastAPI) -> None:
    """The OpenAPI schema as the service answers: our error model on every route, no 422."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = make()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
