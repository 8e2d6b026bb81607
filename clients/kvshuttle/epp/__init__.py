"""kvshuttle's endpoint picker (`kvshuttle-epp`): an Envoy ext_proc server that implements the
Gateway API Inference Extension's endpoint picker protocol, planning each request with the
router as the gateway would and picking the plan's decode pod (docs/operations/endpoint-picker.md)."""
