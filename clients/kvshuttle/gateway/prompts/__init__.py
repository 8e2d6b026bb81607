"""A request's prompt as the engines get it: token ids computed exactly as the engine would
(`prompt`, `tokenizer`, the chat template's jinja2 setup in `chat_template`), spliced onto the
conversation's exact-token history (`history`), and the tenants' vLLM cache salts (`salts`)."""
