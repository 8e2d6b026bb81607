"""The router's gRPC side: RouterService (`servicer`, `convert`, `authz`) and the ports' adapters
over the registry's and the agents' gRPC clients (`registry_port`, `agent_port`). The domain
modules beside this package never import it."""
