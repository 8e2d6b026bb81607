"""The OpenAI-compatible request pipeline every HTTP front of kvshuttle shares (the gateway, the
endpoint picker, the decode-side sidecar): what a request may carry (`protocol`), its prompt as
token ids exactly as the engine computes them (`prompt`, over kvshuttle.gateway.prompts), and
decode's answer as OpenAI objects (`responses`). No aiohttp; `protocol` and `responses` import
no grpc either."""
