"""lily.server: the OpenAI-compatible HTTP server behind `lily serve` (docs/server.md).

    from lily.server.app import ServerConfig, create_app, serve
    serve(lily.load(...), port=8000, config=ServerConfig(api_key="...", session_dir="..."))

`app` needs the server extra (fastapi, uvicorn, llguidance); the output parsers (`reasoning`, `tool_calls`)
are plain Python.
"""
