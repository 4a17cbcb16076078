"""The HTTP gateway: OpenAI-compatible API, tenant auth, quotas, cache-aware routing to engine
workers, exact metering, files and batches, observability. Never imports torch; of `workers/` it
imports only the wire contract (`workers.wire`).

A generation request walks the rooms in order (gateway/openai/views.py): authenticate (`auth/`) →
parse (`openai/`) → admit (`quotas/`) → exchange with a worker (`upstream/`) → meter (`billing/`).
`app.py` is the factory (one `setup_*` per concern), `settings.py` the settings, `state.py` the
typed app-state keys; `api/` holds what every route shares (routes, errors, bodies, transactions).
"""
