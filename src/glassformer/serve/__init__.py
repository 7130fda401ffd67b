"""`glassformer serve`: the model behind an OpenAI-compatible HTTP API (docs/serve.md).

    http.py      the app's base: Host check, body limits and deadlines, CORS, API key, the runner
    schemas.py   request bodies, checked strictly, and OpenAI's error objects
    replies.py   an engine ticket's events as text pieces (stop strings, end-of-turn tokens)
    results.py   the response objects: choices, log-probabilities, usage
    sse.py       server-sent events in OpenAI's chunk format
    openai.py    the routes: /v1/models, /v1/completions, /v1/chat/completions, /health, /tokenize, /detokenize
    worker.py    the engine in a process of its own (ProcessEngine), what `glassformer serve` runs by default
"""
