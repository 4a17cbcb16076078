"""What every route shares: the route table, OpenAI-style errors and the error middleware, JSON
bodies under limits, accounting transactions off the event loop, the OpenAPI document."""
