"""kvshuttle's reference OpenAI-compatible HTTP gateway (`kvshuttle-gateway`).

For users without a gateway of their own: POST /v1/chat/completions and /v1/completions
(streaming or not), GET /v1/models and /health. Each request is a turn of a conversation
(`conversation_id` in the body or the X-Conversation-ID header, else vLLM's `session_id` or
X-Session-ID; scoped by the API key's tenant) driven through the router: PlanTurn, prefill
(max_tokens 1), decode (streamed to the client), CommitTurn. See kvshuttle.gateway.turns.runner
for the turn, kvshuttle.gateway.http.app for its HTTP server, kvshuttle.gateway.config for the
settings.
"""
