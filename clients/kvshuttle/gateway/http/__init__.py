"""The gateway's HTTP server (`app`): routes, API keys, SSE and error responses, over the request
pipeline of kvshuttle.gateway.openai. Only this package imports aiohttp."""
