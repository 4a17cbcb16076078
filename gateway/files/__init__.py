"""OpenAI's Files API: uploads checked as batch input, listed, read and deleted per tenant."""
