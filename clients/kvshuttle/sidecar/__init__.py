"""`kvshuttle-sidecar`: the decode pod's side of llm-d's P/D protocol, with kvshuttle's turns.

Behind a Gateway API Inference Extension endpoint picker (kvshuttle's EPP, or llm-d's), the
gateway forwards each request to a decode pod's sidecar; this one runs the EPP's planned turn
(D->P reuse, recompute or extend) with the gateway's turn runner, or serves it as llm-d's
routing sidecar does. See kvshuttle.sidecar.app for the modes, .config for the
settings, .allowlist for the SSRF guard, .proxy for llm-d's P->D, and
docs/operations/llm-d-sidecar.md.
"""
