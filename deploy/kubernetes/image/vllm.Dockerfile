# syntax=docker/dockerfile:1
# Your vLLM image, with kvshuttle's vLLM plugin (deploy/vllm/plugin: streamed kv_transfer_params
# on vLLM 0.32) and NIXL at the version kvshuttle's agent speaks. Build from the repository root:
#   docker build -f deploy/kubernetes/image/vllm.Dockerfile \
#     --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0@sha256:... -t REGISTRY/kvshuttle/vllm-openai-kvshuttle:v0.32.0-kvshuttle0.1.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY deploy/vllm/plugin /tmp/kvshuttle-vllm-plugin
RUN python3 -m pip install --no-cache-dir --no-deps nixl-cu12==1.5.1 nixl==1.5.1 \
    && python3 -m pip install --no-cache-dir --no-deps /tmp/kvshuttle-vllm-plugin \
    && rm -rf /tmp/kvshuttle-vllm-plugin \
    && python3 -c 'import nixl._api'
