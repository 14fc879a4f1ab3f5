"""The web console and its JSON API: ``kdelay web``.

One ASGI application (FastAPI, served by uvicorn) with server-rendered pages
(Jinja2, and htmx vendored in ``static/`` at a pinned version with its
licence) and a JSON API under ``/api/v1``:

- :mod:`~kdelay.web.access`: who is asking (loopback, hashed secrets, a
  trusted proxy's user header), their role, and the CSRF token;
- :mod:`~kdelay.web.problems`: errors as a stable code and a status, never a traceback;
- :mod:`~kdelay.web.reads`: what the screens show, read through the operator's view;
- :mod:`~kdelay.web.actions`: cancel, reschedule and deliver now as protocol
  requests, their outcomes, and the audit records of who did what and why;
- :mod:`~kdelay.web.api` and :mod:`~kdelay.web.pages`: the routes, thin;
- :mod:`~kdelay.web.app`: the application that joins them.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`,
:mod:`kdelay.view` and the client helpers. Never the engine: the console
acts only through the request protocol, as any producer does.
"""
