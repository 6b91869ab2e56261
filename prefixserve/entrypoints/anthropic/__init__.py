"""The Anthropic Messages API (`/v1/messages`, `cache_control` breakpoints) on the server's shell
(`server/`): the same engine client, tenants and admission as the OpenAI routes. Imports the
shell and `chat/`, never `openai/`."""
