"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated as vLLM does
(`validate`), and the structural tag that constrains decode's tool calls (`structural_tags`)."""
