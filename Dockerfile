# megatron-trace: trainer (Megatron-Core + Transformer Engine) and rollout (SGLang + our plugin)
# in one image. Build: docker build -t megatron-trace:0.1.0 .   (see docs/cluster.md)
# The NGC base brings CUDA, cuDNN, NCCL, PyTorch and Transformer Engine built for them.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
ARG MEGATRON_CORE_VERSION=0.19.2
ARG TRANSFORMER_ENGINE_VERSION=2.20.2
ARG TENSORBOARD_VERSION=2.20.0

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SGLANG_PLUGINS=trace_fp4 \
    PATH=/opt/megatron-trace/.local/bin:${PATH}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Third-party pins first (a code change then reuses this layer).
RUN pip install --no-cache-dir \
        "sglang[all]==${SGLANG_VERSION}" \
        "megatron-core==${MEGATRON_CORE_VERSION}" \
        "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}" \
        "tensorboard==${TENSORBOARD_VERSION}" \
        "safetensors==0.6.2" "pyyaml==6.0.2" "tqdm==4.67.1" "tenacity==9.2.1" \
    && useradd --create-home --uid 1000 --user-group --home-dir /opt/megatron-trace trace

WORKDIR /opt/megatron-trace/src
COPY --chown=1000:1000 setup.py README.md ./
COPY --chown=1000:1000 megatron_trace ./megatron_trace
COPY --chown=1000:1000 sglang_backend ./sglang_backend
COPY --chown=1000:1000 configs ./configs
COPY --chown=1000:1000 scripts ./scripts

# Our package with the `sglang.srt.plugins` entry point (trace_fp4); --no-deps keeps the pins above.
RUN pip install --no-cache-dir --no-deps -e /opt/megatron-trace/src \
    && python -c "import sglang_backend.plugin, megatron_trace" \
    && command -v tensorboard

USER 1000:1000
ENV HOME=/opt/megatron-trace
EXPOSE 30000 6006
HEALTHCHECK --interval=60s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sglang_backend.plugin"]
CMD ["python", "-m", "sglang_backend.launch", "--help"]
