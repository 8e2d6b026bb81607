#!/bin/sh
# The vLLM container's entry point: a fresh NixlConnector engine id on every start of the
# container (readers cache a remote engine's NIXL metadata by its id, so a restarted engine must
# never reuse one), put into $KV_TRANSFER_CONFIG's @ENGINE_ID@ and written to
# $KVSHUTTLE_ENGINE_ID_FILE for the agent beside it. Arguments go to vLLM's API server.
set -eu
suffix=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
engine_id="${POD_NAME}-${suffix}"
printf '%s\n' "$engine_id" >"${KVSHUTTLE_ENGINE_ID_FILE}.tmp"
mv "${KVSHUTTLE_ENGINE_ID_FILE}.tmp" "$KVSHUTTLE_ENGINE_ID_FILE"
kv_transfer_config=$(printf '%s' "$KV_TRANSFER_CONFIG" | sed "s/@ENGINE_ID@/${engine_id}/g")
exec "${ENGINE_PYTHON:-python3}" -m vllm.entrypoints.openai.api_server "$@" \
  --kv-transfer-config "$kv_transfer_config"
