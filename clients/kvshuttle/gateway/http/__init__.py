"""The gateway's OpenAI HTTP surface: the aiohttp server (`app`), what a request may carry
(`protocol`), the request's prompt as token ids (`prompt`, over kvshuttle.gateway.prompts) and
decode's answer as OpenAI objects (`responses`). Only `app` imports aiohttp."""
