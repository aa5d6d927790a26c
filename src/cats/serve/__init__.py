"""``cats serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model, one decode at a time.

    engine.py    the generation slot: a bounded first-come-first-served queue, decoding on a worker thread,
                 cancellation between target forwards
    protocol.py  the OpenAI request bodies (pydantic) and error bodies
    app.py       the FastAPI routes: /v1/chat/completions, /v1/completions, /v1/models, /health; server-sent events
    cli.py       the ``cats serve`` command

Only ``cli.py`` is imported by ``cats`` itself; the rest needs the ``serve`` extra (``pip install 'cats[serve]'``).
"""
