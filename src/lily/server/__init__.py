"""lily.server: the OpenAI-compatible HTTP server behind `lily serve` (docs/server.md).

    from lily.server.app import ServerConfig, create_app, serve
    serve(lily.load(...), port=8000, config=ServerConfig(api_key="...", session_dir="..."))

`app` needs fastapi, uvicorn and llguidance (lily's dependencies); the output parsers (`reasoning`, `tool_calls`)
are plain Python.
"""
