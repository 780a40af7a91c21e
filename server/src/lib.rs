//! ExactScore server library: exact per-token log-probabilities of compressed-tensors
//! checkpoints (model + quantized layers), the batching engine and the HTTP API.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod model;
pub mod quant;
