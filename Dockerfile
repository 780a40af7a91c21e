# ExactScore server (and the `exactscore` client) in two flavours from one Dockerfile:
#
#   CPU:   docker build --target cpu -t exactscore:cpu .
#          docker run -p 8000:8000 exactscore:cpu            (serves the bundled tiny model)
#   CUDA:  docker build --build-arg CUDA_COMPUTE_CAP=90 -t exactscore .   (the default target)
#          (90 = H100/H200, 89 = L40S/RTX 4090, 80 = A100)
#          docker run --gpus all -p 8000:8000 -v /models/my-w4a16:/model:ro \
#            -e EXACTSCORE_MODEL=/model -e EXACTSCORE_DEVICE=cuda:0 -e EXACTSCORE_DTYPE=bf16 exactscore
#
# Both run as uid 10001, listen on 0.0.0.0:8000 and report health with
# `exactscore-server --healthcheck` (GET /health/ready on its own port; no curl needed).
# Without a model mounted they serve the bundled tiny fixture model. Settings: README.md,
# "Configuration" (every flag has an EXACTSCORE_* variable).
#
# The base images come from Docker Hub (rust, debian, nvidia/cuda). Where no registry is
# reachable, build local stand-ins from Debian's packages and pass them as build arguments:
# scripts/docker_local_bases.sh does that and builds the CPU target (README.md, "Docker").

ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG CPU_BASE_IMAGE=debian:bookworm-slim
ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

# ---------------------------------------------------------------------------------------------
# CPU
FROM ${RUST_IMAGE} AS cpu-builder
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p exactscore-server -p exactscore-client --bins \
    && mkdir -p /out \
    && cp target/release/exactscore-server target/release/exactscore /out/

FROM ${CPU_BASE_IMAGE} AS cpu
RUN useradd --system --uid 10001 --user-group --no-create-home exactscore
COPY --from=cpu-builder /out/ /usr/local/bin/
COPY --from=cpu-builder /src/tests/fixtures/llama-w4a16-g128 /opt/exactscore/tiny-model
COPY --from=cpu-builder /src/tests/fixtures/corpus /opt/exactscore/corpus
USER 10001:10001
ENV EXACTSCORE_MODEL=/opt/exactscore/tiny-model \
    EXACTSCORE_HOST=0.0.0.0 \
    EXACTSCORE_PORT=8000 \
    EXACTSCORE_WIKITEXT_PATH=/opt/exactscore/corpus/wikitext-2-raw-test.txt.gz
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["exactscore-server", "--healthcheck"]
ENTRYPOINT ["exactscore-server"]

# ---------------------------------------------------------------------------------------------
# CUDA (default target)
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS cuda-builder
ARG CUDA_COMPUTE_CAP=90
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Distribution packages are not pinned: the CUDA base tag pins the distribution release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates build-essential pkg-config \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
ENV PATH=/root/.cargo/bin:$PATH \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    NVCC=/usr/local/cuda/bin/nvcc
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features cuda -p exactscore-server --bins \
    && cargo build --release --locked -p exactscore-client \
    && mkdir -p /out \
    && cp target/release/exactscore-server target/release/exactscore-bench target/release/exactscore /out/

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS cuda
RUN useradd --system --uid 10001 --user-group --no-create-home exactscore
COPY --from=cuda-builder /out/ /usr/local/bin/
COPY --from=cuda-builder /src/tests/fixtures/llama-w4a16-g128 /opt/exactscore/tiny-model
COPY --from=cuda-builder /src/tests/fixtures/corpus /opt/exactscore/corpus
USER 10001:10001
ENV EXACTSCORE_MODEL=/opt/exactscore/tiny-model \
    EXACTSCORE_HOST=0.0.0.0 \
    EXACTSCORE_PORT=8000 \
    EXACTSCORE_WIKITEXT_PATH=/opt/exactscore/corpus/wikitext-2-raw-test.txt.gz
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["exactscore-server", "--healthcheck"]
ENTRYPOINT ["exactscore-server"]
