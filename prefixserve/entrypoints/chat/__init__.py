"""What both dialects (OpenAI chat, Anthropic Messages) share about chats: the packaged
tool-capable chat templates (`templates/`), the tool-call parsers (`tool_parsers/`), the grammar
that holds a call to its tool's schema (`tool_grammar.py`)."""
