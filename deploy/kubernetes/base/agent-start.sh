#!/bin/sh
# The agent container's entry point: the agent registers the engine id the vLLM container beside
# it drew at its start ($KVSHUTTLE_ENGINE_ID_FILE), and is stopped when that container starts
# again with a new id, so the kubelet restarts it with the new one (the registry then drops the
# old engine's retentions). SIGTERM goes to the agent, which deregisters and drains.
set -eu
until [ -s "$KVSHUTTLE_ENGINE_ID_FILE" ]; do sleep 1; done
engine_id=$(cat "$KVSHUTTLE_ENGINE_ID_FILE")
KVSHUTTLE_AGENT_NODE__ENGINE_ID="$engine_id" "${AGENT_COMMAND:-kvshuttle-agent}" &
agent=$!
trap 'kill -TERM "$agent" 2>/dev/null || true' TERM INT
while kill -0 "$agent" 2>/dev/null; do
  if [ "$(cat "$KVSHUTTLE_ENGINE_ID_FILE" 2>/dev/null || true)" != "$engine_id" ]; then
    echo '{"event": "agent.engine_id_changed", "level": "warning"}' >&2
    kill -TERM "$agent" 2>/dev/null || true
    break
  fi
  sleep "${ENGINE_ID_POLL_S:-2}" &
  wait $! || true
done
status=0
wait "$agent" || status=$?
exit "$status"
