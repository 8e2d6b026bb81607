"""The gateway's OpenAI HTTP surface: the aiohttp server (`app`), what a request may carry
(`protocol`), decode's answer as OpenAI objects (`responses`) and OpenAI-style error bodies
(`errors`). Only `app` imports aiohttp."""
