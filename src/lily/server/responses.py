"""`POST /v1/responses` (OpenAI Responses API)."""
from __future__ import annotations


def add_responses_routes(app, srv, parse) -> None:
    return None
