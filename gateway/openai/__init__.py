"""The OpenAI-compatible surface: request validation, prompt building (chat templates, context
budget), response and SSE building, and the generation views that run the request pipeline."""
