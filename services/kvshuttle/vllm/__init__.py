"""What kvshuttle knows of vLLM's wire formats (kv_transfer_params, KV events)."""
