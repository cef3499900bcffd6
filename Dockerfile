# The image `dtorch submit k8s` names by default: ghcr.io/dtorch/dtorch:latest.
#   docker build -t ghcr.io/dtorch/dtorch:latest .
# CUDA wheels of torch come from PyTorch's index (TORCH_INDEX; a CPU image: .../whl/cpu).
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# g++: torch.compile's CPU code generation; procps: `ps` for the hang reports
RUN apt-get update && apt-get install -y --no-install-recommends g++ procps \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /opt/dtorch
COPY pyproject.toml README.md ./
COPY dtorch ./dtorch
RUN pip install --no-cache-dir ".[hf,gpu,k8s]"
# the pods' working directory; checkpoints go to the mounted volume (--pvc)
WORKDIR /workspace
ENTRYPOINT []
CMD ["dtorch", "--help"]
