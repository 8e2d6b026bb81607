"""The turn runner (`runner`: PlanTurn -> prefill -> decode -> CommitTurn) and what it stands on:
the Turn record and the engines' request bodies (`record`), the ports it calls (`ports`) and
their adapters over gRPC (`router_port`) and aiohttp (`engines`), the `request.done` line
(`request_log`) and the work that outlives a request (`background`). Only the two adapters
import a transport."""
