# ExactScore server with the CUDA engine.
#   docker build --build-arg CUDA_COMPUTE_CAP=90 -t exactscore .      (90 = H100/H200, 89 = L40S/4090, 80 = A100)
#   docker run --gpus all -p 8000:8000 -v /models/my-w4a16:/model:ro \
#     -e EXACTSCORE_MODEL=/model -e EXACTSCORE_DEVICE=cuda:0 -e EXACTSCORE_DTYPE=bf16 exactscore
# Without a model mounted it serves the bundled tiny fixture model.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS builder
ARG CUDA_COMPUTE_CAP=90
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates build-essential pkg-config \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
ENV PATH=/root/.cargo/bin:$PATH \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    NVCC=/usr/local/cuda/bin/nvcc
WORKDIR /src
COPY . .
RUN cargo build --release --features cuda -p exactscore-server --bins

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
RUN useradd --system --uid 10001 --no-create-home exactscore
COPY --from=builder /src/target/release/exactscore-server /src/target/release/exactscore-bench /usr/local/bin/
COPY --from=builder /src/tests/fixtures/llama-w4a16-g128 /opt/exactscore/tiny-model
USER 10001
ENV EXACTSCORE_MODEL=/opt/exactscore/tiny-model \
    EXACTSCORE_HOST=0.0.0.0 \
    EXACTSCORE_PORT=8000
EXPOSE 8000
ENTRYPOINT ["exactscore-server"]
