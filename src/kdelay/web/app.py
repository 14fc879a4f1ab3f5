"""The console's ASGI application: routes, static files, and every error as a stable code.

:func:`create_app` joins the API (``/api/v1``, with its OpenAPI schema at
``/api/v1/openapi.json`` and docs at ``/api/v1/docs``), the pages and the
vendored static files. Errors answer JSON under ``/api/`` and an error page
elsewhere, always with a stable code: input FastAPI cannot bind (a missing
field, a number that is not one) is 400 ``invalid-argument``; Kafka failures
are 503; anything unexpected is 500 ``internal``, its traceback logged and
never sent.
"""

from __future__ import annotations

import logging
from pathlib import Path

from confluent_kafka import KafkaException
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from kdelay import __version__
from kdelay.client import DeliveryError, RequestRefused
from kdelay.controls import ControlsUnavailable
from kdelay.outcomes import NoOutcome
from kdelay.plumbing.connection import ConnectionFailure
from kdelay.plumbing.topics import LayoutError
from kdelay.protocol.controls import ControlError
from kdelay.state.changelog import RestoreError
from kdelay.view.lookup import NotARequest
from kdelay.view.pending import ViewBusy
from kdelay.web import api, pages
from kdelay.web.console import Console
from kdelay.web.problems import INTERNAL, UNAUTHENTICATED, Problem

STATIC = Path(__file__).parent / "static"
log = logging.getLogger(__name__)
_HTTP_CODES = {404: "not-found", 405: "method-not-allowed"}
KNOWN: tuple[type[Exception], ...] = (
    NotARequest, RequestRefused, LayoutError, NoOutcome, ConnectionFailure, ViewBusy,
    RestoreError, DeliveryError, KafkaException, ControlError, ControlsUnavailable)
"""Failures of the layers below that answer with their own code, not ``internal``."""


def create_app(console: Console) -> FastAPI:
    """The console's application, serving ``console``."""
    app = FastAPI(title="kdelay console", version=__version__,
                  description="The kdelay web console's JSON API.",
                  openapi_url="/api/v1/openapi.json", docs_url="/api/v1/docs", redoc_url=None)
    app.state.console = console
    app.include_router(api.router, prefix="/api/v1")
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_exception_handler(Problem, _answer_problem)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _answer_invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _answer_http)  # type: ignore[arg-type]
    for known in KNOWN:
        app.add_exception_handler(known, _answer_unexpected)
    app.add_exception_handler(Exception, _answer_unexpected)
    return app


def problem_of(exc: Exception) -> Problem:
    """The :class:`Problem` a known failure of the layers below answers as."""
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, NotARequest):
        return Problem(400, exc.code, str(exc))
    if isinstance(exc, (RequestRefused, ControlError)):
        return Problem(400, exc.code, str(exc))
    if isinstance(exc, (LayoutError, NoOutcome)):
        return Problem(503, exc.code, str(exc))
    if isinstance(exc, (ConnectionFailure, ViewBusy, ControlsUnavailable)):
        return Problem(503, exc.code, str(exc))
    if isinstance(exc, RestoreError):
        return Problem(503, "restore-failed", str(exc))
    if isinstance(exc, DeliveryError):
        return Problem(502, exc.code, str(exc))
    if isinstance(exc, KafkaException):
        return Problem(503, "kafka", str(exc.args[0]) if exc.args else "Kafka failed")
    return Problem(500, INTERNAL, "the console failed; its log says why")


def respond(request: Request, problem: Problem) -> Response:
    """Answer ``problem`` as JSON for the API, as an error page otherwise."""
    headers = {}
    if problem.code == UNAUTHENTICATED and console_users(request):
        headers["WWW-Authenticate"] = 'Basic realm="kdelay", charset="UTF-8"'
    if request.url.path.startswith("/api/"):
        return JSONResponse(problem.body(), status_code=problem.status, headers=headers)
    response = pages.TEMPLATES.TemplateResponse(
        request, "error.html", {"problem": problem, "who": None, "csrf": None},
        status_code=problem.status)
    response.headers.update(headers)
    return response


def console_users(request: Request) -> bool:
    """Whether the console checks users' secrets (so a browser may ask for them)."""
    console: Console = request.app.state.console
    return bool(console.gate.policy.users)


async def _answer_problem(request: Request, exc: Problem) -> Response:
    return respond(request, exc)


async def _answer_invalid(request: Request, exc: RequestValidationError) -> Response:
    fields = sorted({".".join(str(p) for p in error.get("loc", ())[1:]) or "body"
                     for error in exc.errors()})
    return respond(request, Problem(400, "invalid-argument",
                                    f"missing or malformed: {', '.join(fields)}"))


async def _answer_http(request: Request, exc: HTTPException) -> Response:
    code = _HTTP_CODES.get(exc.status_code, f"http-{exc.status_code}")
    return respond(request, Problem(exc.status_code, code, str(exc.detail)))


async def _answer_unexpected(request: Request, exc: Exception) -> Response:
    problem = problem_of(exc)
    if problem.code == INTERNAL:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return respond(request, problem)
