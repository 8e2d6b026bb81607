"""Token ids computed exactly as the engine would (`tokenizer`, the chat template's jinja2 setup
in `chat_template`), a conversation's exact-token history to splice a prompt onto (`history`),
and the tenants' vLLM cache salts (`salts`)."""
