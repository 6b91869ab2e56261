"""The Anthropic Messages API (`/v1/messages`, `cache_control` breakpoints) over the same engine
client, tenants and admission as the OpenAI routes."""
