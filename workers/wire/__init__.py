"""The one contract between tollway's processes, torch-free and framework-free.

- `generate`: the generate request body and its result lines (both transports), the joined answer;
- `sampling`: sampling parameters, validated;
- `channel`: the generate channel's typed frames, `MAX_FRAME_BYTES`, the `cancel` verb;
- `telemetry`: tracing settings, tracer providers, the W3C propagator (one copy for every process);
- `tokenizer`: the tokenizer files a worker serves and how both sides render chat templates;
- `batches`: Celery task and queue names, the batch-line header, the broker URL rule;
- `files`: files shared in $TOLLWAY_HOME (the admin key);
- `key_events`: key invalidations broadcast to every gateway replica.
"""
